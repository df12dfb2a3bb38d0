"""The ``diloco`` command line: Typer commands and Rich rendering only, no business logic."""
