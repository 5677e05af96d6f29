"""The UI: the %%fasttrain magic, the Panel widget, the command line."""
