"""`zipage quality`'s flags default to `QualitySettings`' own values, declared once in a torch-free
module (`zipage.analysis.quality_settings`), and its help needs no torch (an optional extra).
No model, no torch: these run everywhere."""

from __future__ import annotations

import subprocess
import sys

from zipage.analysis.quality_settings import QualitySettings
from zipage.cli.parser import build_parser
from zipage.cli.quality import settings_of


def test_the_flags_left_out_are_the_settings_defaults():
    args = build_parser().parse_args(["quality"])
    assert settings_of(args) == QualitySettings()


def test_a_flag_given_overrides_its_setting_alone():
    args = build_parser().parse_args(["quality", "--budgets", "64,128", "--prompts", "5"])
    expected = QualitySettings(budgets=(64, 128), prompts=5)
    assert settings_of(args) == expected


def test_help_shows_the_defaults_and_imports_no_torch():
    # A fresh interpreter: this one may have imported torch for another test.
    code = ("import sys\n"
            "from zipage.cli.parser import main\n"
            "try:\n"
            "    main(['quality', '--help'])\n"
            "except SystemExit:\n"
            "    pass\n"
            "print(sorted(name for name in sys.modules if name.split('.')[0] == 'torch'))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    *help_lines, modules = done.stdout.rstrip().splitlines()
    assert modules == "[]", f"zipage quality --help imported {modules}"
    text = " ".join(" ".join(help_lines).split())  # argparse wraps the help
    defaults = QualitySettings()
    for shown in (f"(default {','.join(map(str, defaults.budgets))})",
                  f"(default: all, {','.join(defaults.policies)})",
                  f"(default {defaults.prompts})", f"(default {defaults.continuation_len})",
                  f"(default {defaults.needles})", f"(default {defaults.prompt_tokens})",
                  f"(default {defaults.block_size})", f"(default {defaults.window})",
                  f"(default {defaults.seed})"):
        assert shown in text, shown
