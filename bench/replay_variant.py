"""`zipage` with the engine's decode section rule replaced, for before/after runs in one call.

    python bench/replay_variant.py --decode-section never replay TRACE --gpu ... --out OUT

`never` folds every decode row of a graphed mixed step into the prefill launch (the engine before
zipage/prefill_buckets.py's decode section); `always` takes the section wherever the rows fit it,
whatever their contexts; `rule` is the engine's own. Everything after it is `zipage`'s command line.
"""

from __future__ import annotations

import sys

from zipage.cli.parser import main
from zipage.engine import runner
from zipage.prefill_buckets import decode_section_rows

RULES = {"rule": runner.takes_decode_section,
         "never": lambda bucket, num_decode, longest: False,
         "always": lambda bucket, num_decode, longest: 0 < num_decode <= decode_section_rows(bucket)}


def run(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--decode-section" or argv[1] not in RULES:
        print(f"usage: replay_variant.py --decode-section {{{','.join(RULES)}}} ZIPAGE_ARGS...", file=sys.stderr)
        return 2
    runner.takes_decode_section = RULES[argv[1]]
    return main(argv[2:])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
