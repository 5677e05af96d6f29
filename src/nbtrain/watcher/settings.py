"""What a watch may set on someone else's loop: the TrainConfig fields it applies, the
check that refuses the ones the loop decides (its DataLoader, optimizer, epochs), and the
Plan of what one watch may change. Which is which is declared on each field's
`setting(..., watch=...)` in config.py; the lists here are derived from it."""
from __future__ import annotations

import functools

from ..config import SETTINGS, ConfigError, TrainConfig, as_config, watch_refusal, watched_as

AS_WRITTEN = "your loop's own"   # why a setting is as the loop has it
OPTIMIZE_OFF = "optimize=False: your loop runs as written"   # why the watch changes nothing

# The TrainConfig fields a watch applies to someone else's loop: those it changes the loop
# by and those it observes it by; the rest (epochs, batch_size, optimizer, lr, scheduler,
# ...) the loop itself decides.
OWN_LOOP_FIELDS = watched_as("changes") + watched_as("observes")


class Plan:
    """What one watch may change in the loop, decided once as it starts (as nanoGPT makes
    its `ctx` and `scaler` once before its loop): for each field it changes, the reason it
    may not, or '' where it may. Each part reads its line; none asks `optimize` again."""

    __slots__ = ("_why_not",)

    def __init__(self, config: TrainConfig, optimize: bool):
        self._why_not = {name: _why_not(getattr(config, name), optimize)
                         for name in watched_as("changes")}

    def may(self, name: str) -> bool:
        return not self._why_not[name]

    def why_not(self, name: str) -> str:
        return self._why_not[name]

    def refuse(self, name: str, why: str) -> None:
        """Found at the loop's first forward, before any part has read the line: a
        framework that decides `name` itself (its precision, its model's layout)."""
        if not self._why_not[name]:
            self._why_not[name] = why


def _why_not(value, optimize: bool) -> str:
    if not optimize:
        return OPTIMIZE_OFF
    if value is False or value == "off":
        return "off: asked for"
    return ""
# The default log_every's records, from READS_COUNTED_FOR on: every 10 steps, at least
# RECORD_EVERY_S and at most RECORDS_MERGED x 10 steps apart. A record costs ~50 us of cold
# Python (docs/guide/measured.md): every 10 steps of a 0.5 ms step, that is 1% of the loop's
# time, for 200 records a second where the Dashboard draws 4 times a second. The bound in
# steps bounds how late a non-finite loss on a GPU is seen (on the CPU it is seen at once,
# Watcher._record_due). A log_every the user sets is kept exactly.
RECORD_EVERY_S = 0.05
RECORDS_MERGED = 10


def record_floor_s(config: TrainConfig, settings: dict) -> float:
    """How far apart the watch's records are at least (RECORD_EVERY_S), or 0.0 where the
    user set log_every (in `settings`, or a config's other than the default)."""
    chosen = "log_every" in settings or config.log_every != _defaults().log_every
    return 0.0 if chosen else RECORD_EVERY_S


def own_loop_config(config, settings: dict) -> TrainConfig:
    """The watch's TrainConfig: `config` with `settings`; a field the loop decides (given
    here, or set in `config`) is a ConfigError naming it."""
    base = _defaults() if config is None else as_config(config)
    defaults = _defaults()
    for name in settings:
        if name not in SETTINGS:
            raise ConfigError(f"nt.watch() got an unknown setting {name!r}; it takes "
                              f"{', '.join(OWN_LOOP_FIELDS)}.", field=name)
    changed = [name for name in SETTINGS if name in settings
               or getattr(base, name) != getattr(defaults, name)]
    for name in changed:
        if watch_refusal(name):
            raise ConfigError(f"TrainConfig.{name} is not applied to a loop of your own: "
                              f"{watch_refusal(name)}.", field=name)
    if settings.get("on_nan", base.on_nan) == "skip":
        raise ConfigError("TrainConfig.on_nan='skip' would skip your loop's update, which "
                          "runs in your code: nt.watch takes on_nan='stop' (a non-finite loss "
                          "ends the loop at the next step boundary).", field="on_nan")
    loops = [name for name in changed if name not in OWN_LOOP_FIELDS]
    if loops:
        raise ConfigError(f"TrainConfig.{loops[0]} belongs to your loop: under nt.watch the loop "
                          f"you wrote decides it (its DataLoader, optimizer, scheduler, "
                          f"epochs). Change it in your code; nt.watch takes "
                          f"{', '.join(OWN_LOOP_FIELDS)}.", field=loops[0])
    return base.replace(**settings)   # one construction, from the defaults or `config`


@functools.lru_cache(maxsize=1)
def _defaults() -> TrainConfig:
    """TrainConfig's defaults, to compare with and never handed out: a cell that re-runs a
    watch builds one config, not three (each construction checks every field)."""
    return TrainConfig()
