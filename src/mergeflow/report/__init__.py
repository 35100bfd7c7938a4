"""What a researcher sees: the summary table and headline metrics (``summary``), every plot (``plots``), and the
MLflow records of a run (``tracking``, the ``track`` stage)."""
