"""The stages: thin glue from params.yaml and the files of ``Layout`` to the library's functions (``stages``), the
binding of data a data-aware merge reads (``binding``), each merge's source files (``sources``) and imported
checkpoint files as a fine-tune's dependency (``imports``). DVC's commands and Prefect's tasks both call them."""
