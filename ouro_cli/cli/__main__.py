"""The installed `ouro` script and `python -m ouro_cli.cli`: SIGINT and SIGTERM are handled
(signals.py) before the application and its imports load."""

from __future__ import annotations

from ouro_cli.cli import signals


def main() -> None:
    signals.install()
    from ouro_cli.cli.app import main as run

    run()


if __name__ == "__main__":
    main()
