"""User interfaces: the typer CLI (and, later, the web dashboard)."""
