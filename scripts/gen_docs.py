"""Write docs/cli.md from the code (every subcommand's --help, the TrainConfig keys); --check: fail if stale.

Run after changing a flag or a config field: python scripts/gen_docs.py
"""

import argparse
import sys
from pathlib import Path

from spmdkit.cli.reference import render

CLI_MD = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md differs from the code")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not CLI_MD.exists() or CLI_MD.read_text() != text:
            print(f"{CLI_MD} is stale: run python scripts/gen_docs.py", file=sys.stderr)
            return 1
        print(f"{CLI_MD} is up to date")
        return 0
    CLI_MD.write_text(text)
    print(f"wrote {CLI_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
