"""Option texts, decorators and the error policy several commands share (one owner each)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import click

index_cache_option = click.option(
    "--index-cache", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="Folder for index files derived from shards that have none (plain WebDataset sets; default "
         "$RELICV2_INDEX_CACHE, else the user cache folder).",
)


@contextlib.contextmanager
def user_errors(*kinds: type[Exception], option: str | None = None, path: Path | None = None) -> Iterator[None]:
    """Errors of `kinds` (the ones a user can cause) end the command with their one-line message, exit 1; with
    `option`, as a bad value of that option (a usage error, exit 2); with `path`, an OSError too (a full disk,
    a read-only folder), as "<its file, else path>: <why>"."""
    try:
        yield
    except kinds as error:
        if option is not None:
            raise click.BadParameter(str(error), param_hint=option) from None
        raise click.ClickException(str(error)) from None
    except OSError as error:
        if path is None:
            raise
        raise click.ClickException(f"{error.filename or path}: {error.strerror or error}") from None


preset_option = click.option("--preset", "preset_name", metavar="NAME", default=None,
                             help="Same as --config NAME (kept for existing commands).")


def config_or_preset(config_name: str | None, preset_name: str | None) -> str | None:
    """The settings named by `--config` or by its old name `--preset` (not both)."""
    if config_name is not None and preset_name is not None:
        raise click.UsageError("--preset is another name for --config: give one of them")
    return config_name or preset_name
