"""Every run kept: the SQLite store's writer and reader, TensorBoard and MLflow."""
