"""`mla-deploy` and `python -m mla_deploy`: the command line (mla_deploy.cli), imported from here so that Ctrl-C
while its modules load (numpy and the rest: the first half second) ends the command as it does later, in one line,
not with the import's traceback."""

import sys


def main() -> None:
    try:
        from .cli import main as cli
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        raise SystemExit(130) from None
    cli()


if __name__ == "__main__":
    main()
