"""A user's project made by the tests: a git repository holding a small pure-Python package (`src/tally`) with its
test suite, and a history in which commits fix a bug and add the test that shows it (what `history` tasks come from),
among commits that change only documentation or only source, and last one that adds a function, its test and a
module-level constant (a history candidate `env build` rejects: its change is not all in functions). Dates and authors are fixed: the same commits (and
hashes) every time."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

STATS = '''"""Summary statistics of plain lists of numbers."""


def mean(values):
    """The arithmetic mean."""
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)


def median(values):
    """The middle value (the mean of the two middle values for an even count)."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    {median_even}
    return ordered[middle]


def variance(values):
    """The sample variance."""
    centre = mean(values)
    total = 0.0
    for value in values:
        total += (value - centre) ** 2
    return total / {variance_divisor}


def clamp(value, low, high):
    """`value` limited to [low, high]."""
    if value < low:
        return low
    if value > high:
        return high
    return value


def running_total(values):
    """The running sums of `values`."""
    out = []
    total = 0
    for value in values:
        total += value
        out.append(total)
    return out
'''

TEXT = '''"""Small text helpers."""


def word_count(text):
    """How many words `text` has."""
    return len(text.split())


def slug(text):
    """Lower-case words joined by single dashes."""
    words = {slug_words}
    return "-".join(w.lower() for w in words)


def truncate(text, width):
    """`text` cut to `width` characters, with an ellipsis when cut."""
    if len(text) <= width:
        return text
    return text[: {truncate_end}] + "..."


def initials(name):
    """The upper-case initials of a name."""
    return "".join(part[0].upper() for part in name.split() if part)
'''

TEST_STATS = """import pytest

from tally.stats import clamp, mean, median, running_total, variance


def test_mean():
    assert mean([1, 2, 3, 6]) == 3


def test_mean_of_nothing():
    with pytest.raises(ValueError):
        mean([])


def test_median_odd():
    assert median([3, 1, 2]) == 2


def test_clamp():
    assert clamp(5, 0, 3) == 3
    assert clamp(-1, 0, 3) == 0
    assert clamp(2, 0, 3) == 2


def test_running_total():
    assert running_total([1, 2, 3]) == [1, 3, 6]
{more}"""

TEST_TEXT = """from tally.text import initials, slug, truncate, word_count


def test_word_count():
    assert word_count("a b  c") == 3


def test_slug_simple():
    assert slug("Hello World") == "hello-world"


def test_truncate_short():
    assert truncate("abc", 5) == "abc"


def test_initials():
    assert initials("ada lovelace") == "AL"
{more}"""

MEDIAN_TEST = """

def test_median_even():
    assert median([4, 1, 3, 2]) == 2.5
"""
VARIANCE_TEST = """

def test_variance_is_the_sample_variance():
    assert variance([1, 2, 3, 4]) == pytest.approx(5 / 3)
"""
SLUG_TEST = """

def test_slug_collapses_separators():
    assert slug("  Hello,   big World ") == "hello-big-world"
"""
TRUNCATE_TEST = """

def test_truncate_keeps_the_width():
    assert truncate("abcdefghij", 6) == "abc..."
    assert len(truncate("abcdefghij", 6)) == 6
"""

ROUNDED = """

def rounded_mean(values):
    \"\"\"The mean, rounded to PLACES decimal places.\"\"\"
    return round(mean(values), PLACES)
"""
ROUNDED_TEST = """

def test_rounded_mean():
    from tally.stats import rounded_mean

    assert rounded_mean([1, 2, 2]) == 1.67
"""

BUGGY = {"median_even": "pass", "variance_divisor": "len(values)", "slug_words": 'text.split(" ")', "truncate_end": "width"}
FIXED = {
    "median_even": "if len(ordered) % 2 == 0:\n        return (ordered[middle - 1] + ordered[middle]) / 2",
    "variance_divisor": "(len(values) - 1)",
    "slug_words": '[w.strip(",.") for w in text.split()]',
    "truncate_end": "width - 3",
}

FIXES = [
    # (what is fixed, the commit message, the test file and the test it adds)
    (
        "median_even",
        "Fix median of an even number of values\n\nmedian([4, 1, 3, 2]) returned 3: with an even count the "
        "median is the mean of the two middle values.",
        "stats",
        MEDIAN_TEST,
        "test_median_even",
    ),
    (
        "slug_words",
        "slug: collapse repeated separators and drop punctuation\n\nslug('  Hello,   big World ') gave '--hello,---big-world-'.",
        "text",
        SLUG_TEST,
        "test_slug_collapses_separators",
    ),
    ("variance_divisor", "variance: divide by n - 1 (the sample variance)", "stats", VARIANCE_TEST, "test_variance_is_the_sample_variance"),
    ("truncate_end", "truncate: count the ellipsis in the width", "text", TRUNCATE_TEST, "test_truncate_keeps_the_width"),
]
"""Each fix is one commit of the history, in this order."""

PYPROJECT = """[project]
name = "tally"
version = "0.1.0"

[project.optional-dependencies]
test = ["pytest"]

[dependency-groups]
test = ["pytest"]
dev = [{{include-group = "test"}}]

[tool.setuptools.packages.find]
where = ["{source}"]
include = ["tally*"]
"""


def git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "Test",
        "GIT_AUTHOR_EMAIL": "test@example.invalid",
        "GIT_COMMITTER_NAME": "Test",
        "GIT_COMMITTER_EMAIL": "test@example.invalid",
        "GIT_AUTHOR_DATE": "2025-01-01T00:00:00Z",
        "GIT_COMMITTER_DATE": "2025-01-01T00:00:00Z",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_CONFIG_SYSTEM": "/dev/null",
    }
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, env=env).stdout.strip()


def _write(repo: Path, state: dict[str, str], tests: dict[str, list[str]], source: str) -> None:
    package = repo / source / "tally"
    package.mkdir(parents=True, exist_ok=True)
    (repo / "tests").mkdir(exist_ok=True)
    if not (package / "__init__.py").exists():
        (package / "__init__.py").write_text('"""tally: small statistics and text helpers."""\n')
    (package / "stats.py").write_text(STATS.format(**state))
    (package / "text.py").write_text(TEXT.format(**state))
    (repo / "tests" / "test_stats.py").write_text(TEST_STATS.format(more="".join(tests["stats"])))
    (repo / "tests" / "test_text.py").write_text(TEST_TEXT.format(more="".join(tests["text"])))
    (repo / "pyproject.toml").write_text(PYPROJECT.format(source=source))


def make_project(repo: Path, source_dir: str = "src") -> dict:
    """The repository at `repo` (the package in `<source_dir>/tally`; "." for a flat layout); returns
    {"head": hash, "fixes": [{"commit", "message", "test_id", "source", "function", "fixed"}], "outside": the last
    commit's hash}."""
    repo.mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    state, tests = dict(BUGGY), {"stats": [], "text": []}
    _write(repo, state, tests, source_dir)
    (repo / "README.md").write_text("# tally\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "tally: statistics and text helpers")
    fixes = []
    for number, (key, message, test_module, test_text, test_name) in enumerate(FIXES):
        state[key] = FIXED[key]
        tests[test_module].append(test_text)
        _write(repo, state, tests, source_dir)
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", message)
        module = "stats" if key in ("median_even", "variance_divisor") else "text"
        source = str(Path(source_dir, "tally", f"{module}.py"))
        fixes.append(
            {
                "commit": git(repo, "rev-parse", "HEAD"),
                "message": message,
                "test_id": f"tests/test_{test_module}.py::{test_name}",
                "source": source,
                "function": key.split("_")[0],
                "fixed": (repo / source).read_text(),
            }
        )
        if number == 1:  # commits that are not tasks: documentation only, source only
            (repo / "README.md").write_text("# tally\n\nStatistics and text helpers.\n")
            git(repo, "commit", "-q", "-am", "README: say what tally is")
            (repo / source_dir / "tally" / "__init__.py").write_text('"""tally: statistics and text helpers."""\n')
            git(repo, "commit", "-q", "-am", "Shorter package docstring")
    # Last, a commit with its test that also changes module-level code: a history candidate whose change cannot be
    # graded by functions (`env build` rejects it).
    stats, test_stats = repo / source_dir / "tally" / "stats.py", repo / "tests" / "test_stats.py"
    stats.write_text(stats.read_text().replace('numbers."""\n', 'numbers."""\n\nPLACES = 2\n', 1) + ROUNDED)
    test_stats.write_text(test_stats.read_text() + ROUNDED_TEST)
    git(repo, "commit", "-q", "-am", "stats: rounded_mean, to PLACES decimal places")
    return {"head": git(repo, "rev-parse", "HEAD"), "fixes": fixes, "outside": git(repo, "rev-parse", "HEAD")}


if __name__ == "__main__":  # python -m tests.helpers.user_project DIR: the project recipes/smoke-repo-sft.yaml works on
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.helpers.user_project DIR")
    if Path(sys.argv[1]).exists():
        sys.exit(f"{sys.argv[1]}: already exists")
    print(make_project(Path(sys.argv[1]))["head"])
