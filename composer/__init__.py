"""composer: a training orchestrator for agentic coding MoE models.

Everything installs under this one name. The subpackages (`composer.cli`, `composer.rl`, `composer.trainer`, ...)
keep their folders at the top of the repository; `[tool.setuptools.package-dir]` in pyproject.toml maps them here.
"""
