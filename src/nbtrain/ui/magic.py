"""The `%%fasttrain` cell magic: train the model that a notebook cell defines.

    %load_ext nbtrain

    %%fasttrain --max-steps 200 --amp bf16 --optimizer adamw --scheduler cosine --warmup 20
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    train_data = (X, y)
    loss_fn = nn.CrossEntropyLoss()

The magic only writes a TrainConfig and hands it to `nbtrain.fit`; the Run lands in the
user namespace (as `run` unless `--out` names another variable).
"""
from __future__ import annotations

import argparse
import ast
import difflib
import keyword
import os
import types

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from ..config import (
    FACTORY_FIELDS,
    FIELD_NAMES,
    GROUPS,
    SETTINGS,
    ConfigError,
    TrainConfig,
    rejection,
    settings_in,
)
from ..cell_ranks import processes_for, train_cell
from ..kinds import AUTO_FLAG, Flag, text_of
from ..run import TrainingError
from ..watcher import OWN_LOOP_FIELDS

# what a watched cell takes: the settings a watch applies, and how its Run is kept
WATCH_FIELDS = (*OWN_LOOP_FIELDS, "name", "store", "report_to", "report_dir")
_DEFAULTS = TrainConfig()   # the help quotes these, so it cannot drift from the config
_MISSING = object()


def _default(name: str) -> str:
    return f"(default: {text_of(getattr(_DEFAULTS, name))})"


def _option_type(kind):
    """argparse's `type` for a kind: its parse, failing with the kind's own words."""
    def parse(text: str):
        try:
            return kind.parse(text)
        except ValueError as err:   # its text says what was expected and what was given
            raise argparse.ArgumentTypeError(str(err)) from None
    return parse


def _option(meta) -> magic_arguments.argument:
    """The %%fasttrain option of one TrainConfig field, generated from its Setting.

    Every option stores into the field of the same name with default None, so
    `_apply_options` can tell the options the user gave from the ones left out.
    """
    help_text = f"{meta.help} {_default(meta.name)}"
    if isinstance(meta.kind, Flag) or meta.kind is AUTO_FLAG:   # --pin / --no-pin
        return _arg(meta.flag, dest=meta.name, action=argparse.BooleanOptionalAction,
                    help=help_text)
    return _arg(meta.flag, dest=meta.name, type=_option_type(meta.kind),
                metavar=meta.kind.metavar, help=help_text)


def _with_config_options(magic_method):
    """Add one option per TrainConfig field, under its group's heading.

    magic_arguments builds the parser from the decorators in reverse order of application,
    so they are applied last field first.
    """
    for group, (title, _tab) in reversed(GROUPS.items()):
        for meta in reversed(settings_in(group)):
            magic_method = _option(meta)(magic_method)
        magic_method = _group(title)(magic_method)
    return magic_method


_arg = magic_arguments.argument
_group = magic_arguments.argument_group


@magics_class
class FastTrainMagics(Magics):
    """Holds %%fasttrain; `load_ipython_extension` registers it."""

    @magic_arguments.magic_arguments(name="%fasttrain")   # the usage line reads %%fasttrain
    @_group("What to train (variable names in the notebook)")
    @_arg("--model", default="model", metavar="NAME", help="the nn.Module (default: model)")
    @_arg("--data", default="train_data", metavar="NAME",
          help="a Dataset, an (inputs, targets) pair of tensors or a DataLoader "
               "(default: train_data)")
    @_arg("--loss", metavar="NAME",
          help="the loss, called as loss(output, targets) (default: loss_fn when it "
               "exists; without one the model must return the loss)")
    @_arg("--val", metavar="NAME", help="validation data (default: val_data when it exists)")
    @_group("Run")
    @_arg("--config", metavar="NAME",
          help="a TrainConfig to start from; the options given here override it "
               "(default: TrainConfig())")
    @_arg("--resume", metavar="NAME",
          help="continue the Run (or checkpoint path) in NAME, with its settings unless "
               "options here override them")
    @_arg("--out", metavar="NAME",
          help="the variable that receives the Run (default: run, or with --resume of a "
               "Run, that Run's variable)")
    @_arg("--background", action="store_true",
          help="train in a background thread and return at once (default: off)")
    @_arg("--dashboard", action="store_true",
          help="show the live charts (nt.Dashboard) instead of the progress bar (default: off)")
    @_arg("--compare", metavar="OPTION=V1,V2,...",
          help="train once per value of one option, from the same initial weights and "
               "data order, and show the runs side by side; the Comparison goes to --out "
               "(e.g. --compare optimizer=sgd,adam,adamw)")
    @_with_config_options
    @line_cell_magic
    def fasttrain(self, line, cell=None):
        """Train the model the cell defines; options are TrainConfig settings.

        The cell body runs first, in the notebook namespace; then `model` is trained on
        `train_data` with `loss_fn` (and `val_data` when it exists), and the Run lands
        in `run`. Defaults are TrainConfig's, or those of --config / the resumed Run.

            %%fasttrain --epochs 3 --amp bf16 --optimizer adamw --scheduler cosine --warmup 100
            model = Net()
            train_data = (X, y)
            loss_fn = nn.CrossEntropyLoss()

        Interrupting the kernel keeps the model and returns an interrupted Run; continue
        it with the line form, which needs no body:

            %fasttrain --resume run --max-steps 400
        """
        args = _parse_options(self.fasttrain, line)
        if args.out is not None:
            _check_out_name(args.out)
        ns = self.shell.user_ns
        if args.config is None and args.resume is None:   # a bad option fails before the body runs
            _apply_options(TrainConfig(), _with_named_factories(args, ns, cell))
        if cell and cell.strip() and args.processes is not None and \
                processes_for(args.processes) > 1 and self._train_in_processes(ns, args, cell):
            return
        trained, defined = self._run_body_watched(ns, args, cell)
        if trained:   # the cell trained by itself, through whatever it called: that is the run
            return
        args = _with_named_factories(args, ns)
        resume = _resume_target(ns, args.resume)
        args.out = args.out or (args.resume if _is_run(resume) else "run")
        config = _apply_options(_base_config(ns, args.config, resume), args)
        inputs = _training_inputs(ns, args, defined)
        if args.compare:
            self._compare(ns, args, config, inputs)
            return
        run = _train(ns, args, config, resume, inputs)
        _say_outcome(run, args)

    def _compare(self, ns: dict, args, config: TrainConfig, inputs: dict) -> None:
        """--compare: one run per value, shown with nt.compare's charts and table."""
        from IPython.display import display

        from ..tools.compare import compare
        if args.resume or args.background or args.dashboard:
            raise UsageError("--compare trains fresh runs in the foreground: drop --resume, "
                             "--background and --dashboard.")
        configs = _compare_configs(self.fasttrain.parser, args.compare, config)
        try:
            result = compare(inputs["model"], inputs["train_data"], inputs["loss_fn"],
                             configs=configs, val_data=inputs["val_data"], progress="auto")
        except TrainingError as err:
            raise UsageError(f"Training failed: {err}") from err
        except ConfigError as err:
            raise UsageError(str(err)) from None
        ns[args.out] = result
        display(result)

    def _run_body_watched(self, ns: dict, args, cell) -> tuple:
        """Run the cell body inside nt.watch (the options that apply to a loop of one's
        own): a body that trains, itself or through any function it calls, is watched
        from its first step, and its Run lands in `run` (--out). (trained, names bound)."""
        if not cell or not cell.strip():
            return False, []
        self._refused = []
        watch = self._cell_watch(ns, args)
        watch.warns_untrained = False   # a cell that trains nothing is forgotten below
        out = args.out or "run"
        before = dict(ns)   # holds references, so a new object cannot reuse an old id
        run = watch.__enter__()
        if args.resume is None:   # the loop may stop itself: run.stop() in the cell
            ns[out] = run
        error = self._run_watched(cell, watch)
        defined = [name for name, value in ns.items()
                   if not name.startswith("_") and before.get(name, _MISSING) is not value
                   and value is not run]
        if not watch.trained:
            self._forget_watch(ns, out, before, run)
            if error is not None:
                raise UsageError("The cell body failed (error above), so training did not start.")
            return False, defined
        ns[out] = run
        self._say_what_the_loop_decided(args, self._refused)
        if error is not None and run.state == "failed":   # Run all stops; no second traceback
            raise UsageError(f"The loop failed (error above); the failed Run is in `{out}`.")
        print(run.summary_text())
        return True, defined

    def _train_in_processes(self, ns: dict, args, cell) -> bool:
        """--processes N on a cell that trains: the cell, as written, in N processes
        (cell_ranks.py); a failed rank fails it. False where the cell trained nothing there:
        it defines what fit trains, and runs here as any such cell (fit takes --processes)."""
        try:
            run = train_cell(cell, ns, processes_for(args.processes),
                             self._watch_settings(ns, args), _when_it_trains(args.dashboard))
        except ConfigError as err:
            raise UsageError(str(err)) from None
        out = args.out or "run"
        if run.state == "finished" and run.step == 0:   # a cell for fit: it runs here next
            self._forget_watch(ns, out, {}, run)
            return False
        ns[out] = run
        if run.state == "failed":   # raised, not printed: Run all, nbval and papermill stop
            raise TrainingError(f"{run.error}\nThe failed Run is in `{out}`.", run)
        print(run.summary_text())
        return True

    @staticmethod
    def _watch_settings(ns: dict, args) -> dict:
        """The options (and --config's fields) that apply to a loop of one's own."""
        given = {name: value for name, value in vars(args).items()
                 if name in WATCH_FIELDS and value is not None}
        config, defaults = ns.get(args.config) if args.config else None, TrainConfig()
        return {**{name: getattr(config, name) for name in WATCH_FIELDS
                   if getattr(config, name) != getattr(defaults, name)}, **given} \
            if isinstance(config, TrainConfig) else given

    def _cell_watch(self, ns: dict, args):
        """nt.watch with the options (and --config's fields) that apply to a loop of one's own."""
        import nbtrain
        given, progress = self._watch_settings(ns, args), _when_it_trains(args.dashboard)
        while True:   # a value a watch refuses (on_nan='skip') is fit's alone: left to fit
            try:
                return nbtrain.watch(progress=progress, **given)
            except ConfigError as err:
                if err.field not in given:
                    raise UsageError(str(err)) from None
                del given[err.field]
                self._refused = getattr(self, "_refused", []) + [SETTINGS[err.field].flag]

    @staticmethod
    def _forget_watch(ns: dict, out: str, before: dict, run) -> None:
        """A body that trained nothing: no Run of the watch kept, `out` as it was."""
        if ns.get(out) is run:
            if out in before:
                ns[out] = before[out]
            else:
                del ns[out]
        discard = getattr(run, "discard", None)
        if discard is not None:   # the run store's row for it
            discard()

    @staticmethod
    def _say_what_the_loop_decided(args, refused: list) -> None:
        """The options a loop of one's own decides itself: given, but not applied."""
        loops = [SETTINGS[name].flag for name, value in vars(args).items()
                 if name in FIELD_NAMES and name not in WATCH_FIELDS and value is not None]
        loops += refused
        loops += [flag for flag, value in (("--resume", args.resume), ("--compare", args.compare),
                                           ("--background", args.background)) if value]
        if loops:
            print(f"Not applied: {', '.join(loops)} (this cell runs a loop of its own, which "
                  "decides them; with a loop of your own %%fasttrain applies "
                  + ", ".join(SETTINGS[name].flag for name in OWN_LOOP_FIELDS) + ").")

    def _run_watched(self, cell: str, watch):
        """Run the cell; its error (shown by IPython as in any cell) ends the watch."""
        from ..watcher import StopWatching
        shell = self.shell
        saved = shell.custom_exceptions, shell.CustomTB
        shell.set_custom_exc((StopWatching,), lambda *args, **kwargs: None)   # a quiet end
        try:
            error = shell.run_cell(cell).error_in_exec
        except BaseException as exc:
            watch.__exit__(type(exc), exc, exc.__traceback__)
            raise
        finally:
            shell.custom_exceptions, shell.CustomTB = saved
        watch.__exit__(type(error) if error else None, error,
                       error.__traceback__ if error else None)
        return error

# -- options -> TrainConfig -----------------------------------------------------------------

def _parse_options(magic_method, line: str):
    """The options of `line`; an unknown one names the option it most likely meant."""
    try:
        return magic_arguments.parse_argstring(magic_method, line)
    except UsageError as err:
        text = str(err)
        unknown = [w for w in text.partition("unrecognized arguments:")[2].split()
                   if w.startswith("--")]
        hints = [f"{word}: did you mean {_closest_option(word, magic_method.parser)}?"
                 for word in unknown if _closest_option(word, magic_method.parser)]
        raise UsageError("\n".join([text, *hints])) from None


def _closest_option(word: str, parser) -> str:
    """The option `word` most likely meant, matched against each option's flags, its
    field's name and its panel label (--learning-rate -> --lr)."""
    spelled = {}
    for action in parser._actions:
        if not action.option_strings:
            continue
        meta = SETTINGS.get(action.dest)
        aliases = [meta.name, meta.label] if meta else []
        for alias in action.option_strings + ["--" + a.replace("_", "-").replace(" ", "-").lower()
                                              for a in aliases]:
            spelled.setdefault(alias, action.option_strings[0])
    close = difflib.get_close_matches(word.lower(), list(spelled), n=1, cutoff=0.75)
    return spelled[close[0]] if close else ""


def _check_out_name(name: str) -> None:
    if not name.isidentifier() or keyword.iskeyword(name):
        raise UsageError(f"--out {name!r}: expected a Python variable name, such as run2.")


def _apply_options(base: TrainConfig, args) -> TrainConfig:
    """`base` with the options the user gave; a bad value: UsageError with the ConfigError text."""
    changes = {name: value for name, value in vars(args).items()
               if name in FIELD_NAMES and value is not None}
    try:
        return base.replace(**changes)
    except ConfigError as err:
        raise UsageError(str(err)) from None


def _with_named_factories(args, ns: dict, cell=None):
    """`args` with each value of a setting that takes your own class or factory
    (--optimizer, --scheduler) that names a notebook variable, rather than one of the
    setting's names, replaced by that variable.

    Before the body has run (`cell` given), a name the body binds is left out, to be
    looked up once it has run; a name neither the notebook nor the body has stays, and
    TrainConfig rejects it (`--optimizer adamm`: did you mean 'adam'?).
    """
    args = argparse.Namespace(**vars(args))
    for name in FACTORY_FIELDS:
        value = getattr(args, name)
        if not isinstance(value, str) or SETTINGS[name].kind.accepts(value):
            continue
        if value in ns:
            setattr(args, name, None if cell is not None else ns[value])
        elif cell is not None and value in _names_bound_by(cell):
            setattr(args, name, None)
    return args


def _names_bound_by(cell: str) -> set:
    """The names a cell's code assigns, imports or defines (none when it is not plain
    Python, e.g. it holds other magics)."""
    try:
        tree = ast.parse(cell or "")
    except SyntaxError:
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names


def _base_config(ns: dict, name, resume) -> TrainConfig:
    """--config NAME, else the resumed Run's or checkpoint's config, else the defaults."""
    if name is not None:
        value = _lookup(ns, name, "--config", "a TrainConfig",
                        _names_where(ns, lambda v: isinstance(v, TrainConfig)),
                        "TrainConfigs in the namespace")
        if not isinstance(value, TrainConfig):
            raise UsageError(f"--config {name}: expected a TrainConfig, found "
                             f"{type(value).__name__}. Make one with nbtrain.TrainConfig(...).")
        return value
    if _is_run(resume):
        return resume.config
    if resume is not None:   # a checkpoint path: continue with the settings it was saved with
        return _checkpoint_config(resume)
    return TrainConfig()


def _checkpoint_config(path) -> TrainConfig:
    from ..checkpoint import load
    try:
        return TrainConfig.from_dict(load(path)["config"])
    except (OSError, ValueError) as err:   # missing or unreadable file
        raise UsageError(f"--resume {path}: {err}") from None


def _compare_configs(parser, spec: str, base: TrainConfig) -> dict:
    """--compare OPTION=V1,V2: one config per value, named "option=value".

    OPTION is a TrainConfig field or this magic's option (lr, wd, batch-size, amp, ...);
    each value is parsed as that option parses it on the command line.
    """
    option, sep, text = spec.partition("=")
    values = [v for v in text.split(",") if v] if sep else []
    if not option or len(values) < 2:
        raise UsageError(f"--compare {spec!r}: expected OPTION=V1,V2,... with two or more "
                         "values, such as optimizer=sgd,adam,adamw or lr=0.1,0.01.")
    action = _option_action(parser, option)
    if action is None:
        raise UsageError(f"--compare {spec!r}: {option!r} is not a training option; use a "
                         "TrainConfig field such as optimizer, lr, amp or batch_size.")
    configs = {}
    for text_value in values:
        value = _parse_value(action, option, text_value)
        try:
            configs[f"{option}={text_value}"] = base.replace(**{action.dest: value})
        except ConfigError as err:
            raise UsageError(str(err)) from None
    return configs


def _option_action(parser, option: str):
    wanted = option.replace("_", "-").lstrip("-")
    for action in parser._actions:
        names = {s.lstrip("-") for s in action.option_strings} | {action.dest.replace("_", "-")}
        if action.dest in FIELD_NAMES and wanted in names:
            return action
    return None


def _parse_value(action, option: str, text: str):
    """A --compare value, read as the field's kind reads text ("auto" and true/false too)."""
    try:
        return SETTINGS[action.dest].kind.parse(text)
    except ValueError:
        raise UsageError(f"--compare {option}: {rejection(action.dest, text)}") from None


# -- names in the namespace -------------------------------------------------------------------

def _is_run(value) -> bool:
    # duck-typed so the magic needs nothing from the engine but `nbtrain.fit`
    return isinstance(getattr(value, "config", None), TrainConfig) and hasattr(value, "state")


def _resume_target(ns: dict, name):
    """The Run or checkpoint path that --resume names, or None."""
    if name is None:
        return None
    if name not in ns and os.path.exists(name):
        return name
    value = _lookup(ns, name, "--resume", "a Run to continue",
                    _names_where(ns, _is_run), "Runs in the namespace")
    if _is_run(value) and value.state == "running":
        raise UsageError(f"--resume {name}: that Run is still training. Call {name}.stop() "
                         f"and {name}.wait() first, then resume it.")
    if _is_run(value) or isinstance(value, (str, os.PathLike)):
        return value
    raise UsageError(f"--resume {name}: expected a Run (from %%fasttrain or nbtrain.fit) "
                     f"or a checkpoint path, found {type(value).__name__}.")


def _training_inputs(ns: dict, args, defined: list) -> dict:
    """model, train_data, loss_fn and val_data, looked up by the names the options give."""
    listing = [f"{n} ({type(ns[n]).__name__})" for n in defined
               if not isinstance(ns[n], types.ModuleType)]

    def need(name, flag, what):
        return _lookup(ns, name, flag, what, listing, "The cell defined")

    return {
        "model": _check_model(args.model, need(args.model, "--model", "the model")),
        "train_data": need(args.data, "--data", "the training data"),
        "loss_fn": need(args.loss, "--loss", "the loss") if args.loss else ns.get("loss_fn"),
        "val_data": need(args.val, "--val", "the validation data") if args.val
        else ns.get("val_data"),
    }


def _check_model(name: str, model):
    import torch
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{name!r} is a {type(model).__name__}, not a torch.nn.Module: "
                         f"bind the model to {name!r}, or pass --model NAME.")
    return model


def _names_where(ns: dict, test) -> list:
    return [name for name, value in ns.items() if not name.startswith("_") and test(value)]


def _lookup(ns: dict, name: str, flag: str, what: str, candidates: list, source: str):
    if name in ns:
        return ns[name]
    found = ", ".join(candidates) if candidates else "none"
    raise UsageError(f"No variable named {name!r} ({what}). {source}: {found}. "
                     f"Define {name!r}, or pass {flag} NAME to use another variable.")


# -- training and output ----------------------------------------------------------------------

def _train(ns: dict, args, config: TrainConfig, resume, inputs: dict):
    """Call nbtrain.fit and put the Run in the namespace, also when training fails."""
    import nbtrain  # at call time: the package imports this module to load the extension

    from ..entry import ModelBusyError
    progress = _dashboard_progress() if args.dashboard else "auto"
    try:
        run = nbtrain.fit(inputs["model"], inputs["train_data"], inputs["loss_fn"],
                          config=config, val_data=inputs["val_data"], resume=resume,
                          background=args.background, progress=progress)
    except nbtrain.TrainingError as err:
        ns[args.out] = err.run
        raise UsageError(f"Training failed: {err}\nThe failed Run is in `{args.out}`.") from err
    except (ConfigError, ModelBusyError) as err:   # what only the engine can check
        raise UsageError(str(err)) from None
    ns[args.out] = run
    return run


def _when_it_trains(dashboard: bool):
    """The watch's viewer for a cell body, shown at its first record: a body that only
    defines shows no empty bar or chart (and no word about the dashboard)."""
    def attach(run) -> None:
        def first(record) -> None:
            if record["kind"] != "train":   # the end's record of a watch that trained nothing
                return
            run.unsubscribe(first)
            progress = _dashboard_progress() if dashboard else "auto"
            if callable(progress):
                progress(run)
            else:
                from ..views.progress import attach_progress
                attach_progress(run)
        run.subscribe(first)
    return attach


def _dashboard_progress():
    """What --dashboard shows: the live charts where plotly and ipywidgets are installed,
    else the bar."""
    try:
        from ..views.dashboard import Dashboard
    except ImportError:
        print("The live dashboard (--dashboard) needs plotly, anywidget and ipywidgets; "
              "showing the progress bar.")
        return "auto"
    # A blocking fit creates the Run itself, so the dashboard cannot subscribe beforehand:
    # fit calls a callable `progress` with the Run before the first step.
    return Dashboard


def _say_outcome(run, args) -> None:
    out = args.out
    if args.background:
        print(f"Training in the background; the Run is in `{out}`. "
              f"{out}.stop() stops it, {out}.wait() waits for it.")
        return
    if run.state == "interrupted":
        print(f"Interrupted at step {run.step}; the Run is in `{out}`. "
              f"Continue it with: {_resume_command(args)}")
    print(run.summary_text())


def _resume_command(args) -> str:
    """The line that continues this run, with the variable names this cell used."""
    names = [f"{flag} {value}" for flag, value, default in (
        ("--model", args.model, "model"), ("--data", args.data, "train_data"),
        ("--loss", args.loss, None), ("--val", args.val, None)) if value != default]
    return " ".join(["%fasttrain --resume", args.out] + names)


# -- extension hooks (nbtrain.load_ipython_extension delegates here) --------------------------

def load_ipython_extension(ip) -> None:
    """`%load_ext nbtrain`: register %%fasttrain (and its line form %fasttrain)."""
    ip.register_magics(FastTrainMagics)


def unload_ipython_extension(ip) -> None:
    """`%unload_ext nbtrain`: remove %%fasttrain, leaving any other magic of that name alone."""
    manager = ip.magics_manager
    for kind in ("line", "cell"):
        func = manager.magics[kind].get("fasttrain")
        if isinstance(getattr(func, "__self__", None), FastTrainMagics):
            del manager.magics[kind]["fasttrain"]
    if isinstance(manager.registry.get(FastTrainMagics.__name__), FastTrainMagics):
        del manager.registry[FastTrainMagics.__name__]
