"""``python -m ui.dashboard [--port N] …``: ``asyncrl dashboard`` (what ``asyncrl up`` starts)."""

import typer

from ui.dashboard_cli import dashboard

if __name__ == "__main__":
    typer.run(dashboard)
