"""Where a model path comes from: a local folder, else the Hugging Face Hub."""

from __future__ import annotations

from pathlib import Path


def model_not_loadable(what: str, path: str, error: BaseException) -> ValueError:
    """The one-line error for a local path that exists but does not hold a model the loader reads (another
    kind of model, a file cut short, a broken config), with the loader's own reason."""
    reason = " ".join(f"{type(error).__name__}: {error}".split())
    return ValueError(
        f"cannot load the {what} from {path!r}: it exists but does not hold one that loads ({reason})"
    )


def model_not_found(what: str, model_id_or_path: str, error: BaseException) -> OSError:
    """The one-line error for a model that is neither a local folder nor a Hub repository that can be reached,
    naming both places looked at (a relative path is relative to the working directory) and the loader's
    own reason."""
    reason = " ".join(f"{type(error).__name__}: {error}".split())
    if Path(model_id_or_path).is_absolute():
        where = "there is no such folder"
    else:
        where = f"there is no such folder under {Path.cwd()} (a relative path is relative to the working directory)"
    return OSError(
        f"cannot load the {what} {model_id_or_path!r}: {where} and the Hugging Face Hub could not supply it ({reason})"
    )
