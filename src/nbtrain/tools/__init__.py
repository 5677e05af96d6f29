"""The tools that train several runs: compare, lr_find, autotune, profile, the demo."""
