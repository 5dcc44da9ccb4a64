"""What one `zipage quality` study runs (`QualitySettings`), apart from the study itself.

Torch-free, unlike `analysis/quality.py`: the CLI reads these defaults at parse time (its help
shows them, its flags default to them), and torch is an optional extra that `zipage quality
--help` must not need. So each default is declared here once.
"""

from __future__ import annotations

from dataclasses import dataclass

from zipage.config import ZipageConfig
from zipage.errors import ConfigError
from zipage.scoring import SCORING_POLICIES


@dataclass(frozen=True)
class QualitySettings:
    """What one study runs. Block 32 and window 8 let budgets 128/256/512 be 4/8/16 blocks and
    compress every 32 decoded tokens (b >= 2w, as compression needs)."""

    policies: tuple[str, ...] = tuple(SCORING_POLICIES)
    budgets: tuple[int, ...] = (128, 256, 512)
    block_size: int = 32
    window: int = 8
    prompts: int = 3  # agreement prompts
    continuation_len: int = 64  # reference tokens each agreement prompt is forced along
    needles: int = 8  # needle prompts
    prompt_tokens: int = 768  # every prompt's length: a multiple of block_size
    answer_len: int = 8  # needle answer tokens after the forced one (" 48213" is 6)
    seed: int = 0  # the pass keys and the random policy's draws

    def check(self) -> None:
        """A `ConfigError` naming the setting (as its flag) and the fix, before any model loads."""
        unknown = [name for name in self.policies if name not in SCORING_POLICIES]
        if unknown or not self.policies:
            raise ConfigError(f"--policies: unknown policy {', '.join(map(repr, unknown))}; "
                              f"known: {', '.join(SCORING_POLICIES)}" if unknown else
                              "--policies: give at least one policy")
        if len(set(self.policies)) != len(self.policies):
            raise ConfigError("--policies: a policy is named twice")
        # The engine's own knob checks (power-of-two block, b >= 2w), named by their flags.
        try:
            ZipageConfig(block_size=self.block_size, window=self.window,
                         kv_budget=self.block_size).validate()
        except ConfigError as error:
            raise ConfigError("--" + str(error).replace("_", "-", 1)) from None
        if not self.budgets or len(set(self.budgets)) != len(self.budgets):
            raise ConfigError("--budgets: give distinct budgets, e.g. 128,256,512")
        for budget in self.budgets:
            if budget <= 0 or budget % self.block_size:
                raise ConfigError(f"--budgets: {budget} is not a positive multiple of the block "
                                  f"size {self.block_size}")
        if self.prompt_tokens % self.block_size:
            raise ConfigError(f"--prompt-tokens: {self.prompt_tokens} is not a multiple of the "
                              f"block size {self.block_size} (the first decode must compress)")
        if self.prompt_tokens < max(self.budgets) + self.block_size:
            raise ConfigError(f"--budgets: {max(self.budgets)} would never evict from prompts of "
                              f"{self.prompt_tokens} tokens (a prompt must be at least budget + "
                              f"block size); raise --prompt-tokens or lower the budget")
        for name, value, least in (("--prompts", self.prompts, 0), ("--needles", self.needles, 0),
                                   ("--continuation-len", self.continuation_len, 2),
                                   ("answer_len", self.answer_len, 1)):
            if value < least:
                raise ConfigError(f"{name}: got {value}, expected at least {least}")
        if self.prompts == 0 and self.needles == 0:
            raise ConfigError("--prompts and --needles are both 0: nothing to measure")
