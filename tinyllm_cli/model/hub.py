"""``ORG/NAME[@REVISION]`` model ids, resolved to a local directory through ``huggingface_hub``.

Invariants:
- Only a spec that is not an existing local path gets here (``checkpoint.load_checkpoint`` checks
  the path first), so a local directory always wins over a Hub id spelled the same.
- The cache, the offline switch and the token are huggingface_hub's own: ``HF_HOME`` /
  ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE=1``, ``HF_TOKEN`` or ``hf auth login``. With the network off
  a cached snapshot is used as is; nothing is downloaded twice.
- Only what the loader reads is downloaded: config and generation config, the tokenizer files,
  and the safetensors weights the index names (or ``model.safetensors``), never a repo's other
  weight formats. Progress bars are huggingface_hub's, on stderr.
- Every failure is one sentence (``CheckpointError``, exit 1): offline and not cached, gated,
  not found, unknown revision, no network.
- A shard name in the index is downloaded only if it is a plain relative file name
  (``validate.plain_relative``): an index cannot widen the download with wildcards or point it
  outside the snapshot; the loader then refuses such a name with its own sentence.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tqdm.auto import tqdm

from ..errors import CheckpointError
from .validate import plain_relative

# Small files first (one call), then exactly the weight files they name (a second call).
META_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "model.safetensors.index.json"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?$")


def is_hub_id(spec: str) -> bool:
    """``org/name`` or ``org/name@revision``; file-looking names (``x/y.gguf``) are not ids."""
    return bool(_HUB_ID.match(spec)) and not spec.split("@", 1)[0].lower().endswith(".gguf")


def split_id(spec: str) -> tuple[str, str | None]:
    repo, _, rev = spec.partition("@")
    return repo, rev or None


def resolve(spec: str, progress: bool = True) -> Path:
    """The local snapshot directory of Hub model ``spec``, downloading what is missing."""
    repo, rev = split_id(spec)
    where = f"{repo}" + (f" at revision {rev!r}" if rev else "")
    snapshot = _download(repo, rev, META_FILES, progress, where)
    if not (snapshot / "config.json").exists():
        raise CheckpointError(f"Hub repository {where} has no config.json; for a GGUF repository, download "
                              f"the .gguf file and pass its path")
    return _download(repo, rev, _weight_files(snapshot), progress, where)


def _weight_files(snapshot: Path) -> list[str]:
    index = snapshot / "model.safetensors.index.json"
    if not index.exists():
        return ["model.safetensors"]
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        return ["*.safetensors"]  # the loader reports the bad index with its own sentence
    return [s for s in shards if isinstance(s, str) and plain_relative(s)]


class _QuietTqdm(tqdm):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "disable": True})


def _download(repo: str, rev: str | None, patterns: list[str], progress: bool, where: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub import errors as hf

    try:
        path = snapshot_download(repo, revision=rev, allow_patterns=patterns,
                                 tqdm_class=None if progress else _QuietTqdm)
    except hf.GatedRepoError:
        raise CheckpointError(f"Hub repository {repo} is gated: accept its terms on huggingface.co and log in "
                              f"(hf auth login, or set HF_TOKEN)")
    except hf.RevisionNotFoundError:
        raise CheckpointError(f"Hub repository {repo} has no revision {rev!r}")
    except hf.RepositoryNotFoundError:
        raise CheckpointError(f"Hub repository {repo} was not found (or it is private and no token was given)")
    except getattr(hf, "IncompleteSnapshotError", ()) as e:  # newer huggingface_hub only
        raise CheckpointError(f"the cached snapshot of {where} is incomplete and the Hub cannot be reached; "
                              f"run once with network access to finish the download") from e
    except hf.LocalEntryNotFoundError as e:
        if constants.HF_HUB_OFFLINE:
            raise CheckpointError(f"model {where} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                                  f"and HF_HUB_OFFLINE=1 forbids downloading it") from e
        raise CheckpointError(f"model {where} is not in the Hugging Face cache and the Hub cannot be reached") from e
    except hf.HfHubHTTPError as e:
        raise CheckpointError(f"downloading {where} failed ({str(e).splitlines()[0][:200]})") from e
    except OSError as e:
        raise CheckpointError(f"cannot write to the Hugging Face cache for {where} ({e.strerror or e})") from e
    return Path(path)
