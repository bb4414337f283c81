"""Print docs/CONFIG.md, the page of every `model.*` and `train.*` key, as handgrad.config_keys
writes it (the same descriptions as `handgrad train --help`); --write writes it in place.

    python3 tools/config_doc.py --write      # after changing a key in config.py or config_keys.py

tests/test_config_keys.py fails while the page differs from what this prints.
"""
import argparse
import sys
from pathlib import Path

from handgrad.config_keys import markdown

PAGE = Path(__file__).resolve().parents[1] / "docs" / "CONFIG.md"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {PAGE.relative_to(PAGE.parents[1])} instead of printing it")
    args = parser.parse_args(argv)
    if args.write:
        PAGE.write_text(markdown(), encoding="utf-8")
        print(f"wrote {PAGE}")
    else:
        sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
