"""HF cache: the Hugging Face hub cache layout, read (seed a snapshot by repo id) and written (a join's copy).

The hub cache holds a repo as ``models--ORG--NAME/`` with ``blobs/<etag>``
(each file's content, named by its etag), ``snapshots/<commit>/<path>``
(relative symlinks into ``blobs/``) and ``refs/<revision>`` (the commit a
branch or tag names).  ``resolve("org/name@rev")`` finds a snapshot,
``snapshot_of(dir)`` reads its repo, commit and etags for the manifest, and
``publish`` writes a complete copy's snapshot and ref: the blobs first (they
are the node's store files, see ``blob_names``), then the symlinks, then the
ref, so ``from_pretrained`` with ``HF_HUB_OFFLINE=1`` never sees a partial
snapshot.  No huggingface_hub import: the layout is plain files.
"""
from __future__ import annotations

import os
import re

from ..errors import UserError
from ..sources.validate import COMMIT  # one rule for a commit hash, the manifest's and the cache's
from .cache import write_text_atomically
from .paths import inside

REPO_REF = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w][\w./-]*))?$")
DEFAULT_REVISION = "main"


class HFCacheError(UserError, ValueError):
    """A repo id or snapshot that cannot be resolved, or a model that cannot be written in the layout."""


def hub_dir() -> str:
    """The hub cache: ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return os.path.expanduser("~/.cache/huggingface/hub")


def parse_repo_ref(text: str) -> tuple[str, str] | None:
    """``'org/name@rev'`` -> ``('org/name', 'rev')`` (revision ``main`` by default); None if not that form."""
    m = REPO_REF.match(text)
    if not m or ".." in text:
        return None
    return m["repo"], m["rev"] or DEFAULT_REVISION


def repo_folder(repo: str) -> str:
    """``org/name`` -> ``models--org--name``."""
    return "models--" + repo.replace("/", "--")


def resolve(text: str, hub: str | None = None) -> tuple[str, dict]:
    """The snapshot directory of ``ORG/NAME[@REVISION]`` in the hub cache and its ``origin``.

    The revision is looked up in ``refs/`` (a commit hash also names its snapshot directly).
    """
    parsed = parse_repo_ref(text)
    if parsed is None:
        raise HFCacheError(f"{text!r} is neither an existing path nor a Hugging Face repo id ORG/NAME[@REVISION]")
    repo, revision = parsed
    hub = hub or hub_dir()
    root = os.path.join(hub, repo_folder(repo))
    if not os.path.isdir(root):
        raise HFCacheError(f"{text}: no such file or directory, and repo {repo} is not in the Hugging Face cache "
                           f"{hub} (download it there first, e.g. hf download {repo})")
    try:
        with open(os.path.join(root, "refs", revision)) as f:
            commit = f.read().strip()
    except OSError:
        if not COMMIT.fullmatch(revision):
            refs = sorted(_refs(root))
            raise HFCacheError(f"{text}: {repo} in {hub} has no revision {revision!r} "
                               f"(refs there: {', '.join(refs) or 'none'})") from None
        commit = revision
    snapshot = os.path.join(root, "snapshots", commit)
    if not COMMIT.fullmatch(commit) and not os.path.isdir(snapshot):
        raise HFCacheError(f"{root}/refs/{revision} holds {commit[:60]!r}, not a commit hash")
    if not os.path.isdir(snapshot):
        raise HFCacheError(f"{text}: revision {revision} is commit {commit}, whose snapshot is not in {root}/snapshots")
    origin = {"repo": repo, "commit": commit}
    if revision != commit:
        origin["revision"] = revision
    return snapshot, origin


def _refs(root: str):
    base = os.path.join(root, "refs")
    for d, _, files in os.walk(base):
        for name in files:
            yield os.path.relpath(os.path.join(d, name), base)


def snapshot_of(path) -> tuple[dict, dict] | None:
    """``(origin, etags)`` when ``path`` is a hub cache snapshot ``models--ORG--NAME/snapshots/<commit>``, else None.

    ``etags`` maps each file name (relative, '/'-separated) to the name of the blob its symlink
    resolves to; ``origin.revision`` is a ref naming that commit, if one does (``main`` first).
    """
    snap = os.path.abspath(os.fspath(path))
    snapshots = os.path.dirname(snap)
    root = os.path.dirname(snapshots)
    folder = os.path.basename(root)
    if os.path.basename(snapshots) != "snapshots" or not folder.startswith("models--") or "--" not in folder[8:]:
        return None
    org, _, name = folder[8:].partition("--")
    commit = os.path.basename(snap)
    origin = {"repo": f"{org}/{name}", "commit": commit}
    for ref in sorted(_refs(root), key=lambda r: (r != DEFAULT_REVISION, r)):
        try:
            with open(os.path.join(root, "refs", ref)) as f:
                if f.read().strip() == commit:
                    origin["revision"] = ref
                    break
        except OSError:
            continue
    blobs = os.path.realpath(os.path.join(root, "blobs"))
    etags = {}
    for d, _, files in os.walk(snap):
        for fname in files:
            full = os.path.join(d, fname)
            real = os.path.realpath(full)
            if os.path.dirname(real) == blobs:
                etags[os.path.relpath(full, snap).replace(os.sep, "/")] = os.path.basename(real)
    return origin, etags


def blob_names(manifest) -> list[str]:
    """Where each file of ``manifest`` lives in its repo folder: ``blobs/<etag>``.

    A second non-empty file with the same content gets its own ``blobs/<etag>.<n>`` (the store never maps one
    file twice: a bad chunk received for one would overwrite verified bytes of the other); its snapshot link
    still points at ``blobs/<etag>``.
    """
    check_publishable(manifest)
    seen: dict[str, int] = {}
    names = []
    for f in manifest.files:
        etag = f["etag"]
        n = seen.get(etag, 0)
        seen[etag] = n + 1
        names.append(f"blobs/{etag}" if n == 0 or f["size"] == 0 else f"blobs/{etag}.{n}")
    return names


def check_publishable(manifest) -> None:
    """HFCacheError unless ``manifest`` came from a hub snapshot: a repo, a commit, an etag per file."""
    o = manifest.origin or {}
    if not o.get("repo") or not COMMIT.fullmatch(o.get("commit", "")):
        raise HFCacheError("--hf-cache needs a model seeded from a Hugging Face cache (p2pw seed ORG/NAME): "
                           "this manifest names no repo and commit")
    bad = [f["name"] for f in manifest.files if not re.fullmatch(r"[\w.-]+", str(f.get("etag", ""))) or
           str(f.get("etag", "")).startswith(".")]
    if bad:
        raise HFCacheError(f"--hf-cache: files without a usable etag in the manifest: {', '.join(bad[:5])}")
    if parse_repo_ref(o["repo"]) is None:
        raise HFCacheError(f"--hf-cache: repo id {o['repo']!r} in the manifest is not ORG/NAME")


def repo_dir(manifest, hub: str) -> str:
    check_publishable(manifest)
    return os.path.join(os.path.abspath(hub), repo_folder(manifest.origin["repo"]))


def publish(manifest, root: str) -> str:
    """Write the snapshot symlinks, then the ref, of a complete copy whose blobs are in ``root/blobs``.

    Returns the snapshot directory.  Idempotent; each link and the ref appear by rename, the ref durably;
    every path is checked to stay inside ``root`` (``paths.inside``).
    """
    check_publishable(manifest)
    commit = manifest.origin["commit"]
    snap = inside(root, f"snapshots/{commit}")
    for f in manifest.files:
        link = inside(snap, f["name"])
        os.makedirs(os.path.dirname(link), exist_ok=True)
        target = os.path.relpath(inside(root, f"blobs/{f['etag']}"), os.path.dirname(link))
        if os.path.islink(link) and os.readlink(link) == target:
            continue
        tmp = link + ".p2pw-tmp"
        if os.path.lexists(tmp):
            os.remove(tmp)
        os.symlink(target, tmp)
        os.replace(tmp, link)
    revision = manifest.origin.get("revision")
    if revision and revision != commit:
        ref = inside(root, f"refs/{revision}")
        os.makedirs(os.path.dirname(ref), exist_ok=True)
        write_text_atomically(ref, commit, durable=True)
    return snap
