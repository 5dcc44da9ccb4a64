"""`zipage` with an engine rule replaced, for before/after runs in one call.

    python bench/replay_variant.py [--decode-section RULE] [--decode-split SPLIT] replay TRACE --gpu ... --out OUT

--decode-section: `never` folds every decode row of a graphed mixed step into the prefill launch
(the engine before zipage/prefill_buckets.py's decode section); `always` takes the section wherever
the rows fit it, whatever their contexts; `rule` is the engine's own.
--decode-split: the decode kernel's split of a decode step's rows (zipage/decode_grid.py): `batch`
cuts every row alike (the engine before the balanced split); `balanced` by its share of the step's
entries wherever that grid is wider; `rule` is the engine's own (`takes_balanced_split`).
Everything after the options is `zipage`'s command line.
"""

from __future__ import annotations

import sys

from zipage.cli.parser import main
from zipage.decode_grid import decode_grid_partitions, decode_num_partitions
from zipage.engine import runner
from zipage.prefill_buckets import decode_section_rows

RULES = {"rule": runner.takes_decode_section,
         "never": lambda bucket, num_decode, longest: False,
         "always": lambda bucket, num_decode, longest: 0 < num_decode <= decode_section_rows(bucket)}
SPLITS = {"rule": runner.takes_balanced_split,
          "batch": lambda *_, **__: False,
          "balanced": lambda batch, total, longest, *grid, **per_sm: (
              decode_grid_partitions(batch, *grid, **per_sm, split="balanced")
              > decode_num_partitions(batch, *grid, **per_sm))}
USAGE = (f"usage: replay_variant.py [--decode-section {{{','.join(RULES)}}}] "
         f"[--decode-split {{{','.join(SPLITS)}}}] ZIPAGE_ARGS...")


def run(argv: list[str]) -> int:
    while argv and argv[0].startswith("--decode-"):
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        option, value = argv[:2]
        if option == "--decode-section" and value in RULES:
            runner.takes_decode_section = RULES[value]
        elif option == "--decode-split" and value in SPLITS:
            runner.takes_balanced_split = SPLITS[value]
        else:
            print(USAGE, file=sys.stderr)
            return 2
        argv = argv[2:]
    return main(argv)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
