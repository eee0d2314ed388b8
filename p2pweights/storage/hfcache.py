"""HF cache: the Hugging Face hub cache layout, read (seed a snapshot by repo id) and written (a join's copy).

The hub cache holds a repo as ``models--ORG--NAME/`` with ``blobs/<hash>``
(each file's content, named by its sha256, or its git blob sha1 for a small
file), ``snapshots/<commit>/<path>`` (relative symlinks into
``blobs/``) and ``refs/<revision>`` (the commit a branch or tag names).  ``resolve("org/name@rev")`` finds a snapshot,
``snapshot_of(dir)`` reads its repo, commit and etags for the manifest, and
``publish`` writes a complete copy's snapshot and ref: the blobs first (hard
links to the node's store files, see ``blob_names``, each named by the hash
of its verified bytes, never by the manifest's etag: a manifest cannot
name, so overwrite, another snapshot's blob), then the symlinks, then the
ref (only one asked for, or one that moves no ref already there), so
``from_pretrained`` with ``HF_HUB_OFFLINE=1`` never sees a partial snapshot.
No huggingface_hub import: the layout is plain files.
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
LFS_ETAG = re.compile(r"[0-9a-f]{64}")  # the sha256 the hub names an LFS file by (a git blob: 40 hex digits, sha1)
HUB_NAME = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # a blob's name: its git sha1 or its sha256
HASH_BLOCK = 8 << 20  # bytes read at a time to name a blob
MAX_ETAG = 128  # a store file's name holds it (real etags: 40 or 64)


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
    """Where each file of ``manifest`` is written in its repo folder: its own store file
    ``blobs/<etag>.p2pw-<model id>-<n>``, never a blob the hub names (``publish`` links it as the blob its
    bytes name).  Named by the model and the file's index, so no other model's join, and no other file of
    this one (the store never maps one file twice), writes it."""
    check_publishable(manifest)
    return [f"blobs/{f['etag']}.p2pw-{manifest.model_id}-{n}" for n, f in enumerate(manifest.files)]


def hub_name(etag: str, data_size: int, read) -> str:
    """The hub's name for a file's bytes (``read(buf)`` fills ``buf`` until 0): the sha256 of an LFS file (an etag
    of 64 hex digits says it is one), else the git blob sha1, ``sha1(b"blob SIZE\\0" + data)``."""
    import hashlib  # OpenSSL: only once a copy in the hub cache layout is complete, never in a join's start-up

    if LFS_ETAG.fullmatch(etag):
        h = hashlib.sha256()
    else:
        h = hashlib.sha1()
        h.update(b"blob %d\0" % data_size)
    buf = bytearray(HASH_BLOCK)
    view = memoryview(buf)
    while True:
        n = read(buf)
        if not n:
            return h.hexdigest()
        h.update(view[:n])


def _name_of(path: str, etag: str) -> str:
    """``hub_name`` of the file at ``path`` (not followed if a link: OSError ELOOP)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb", buffering=0) as f:
        return hub_name(etag, os.fstat(fd).st_size, f.readinto)


def _same_file(a: str, b: str) -> bool:
    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def place_blob(root: str, store: str, etag: str, known: str | None = None) -> str:
    """``blobs/<name>`` for the verified bytes of the store file ``store``: ``name`` is hashed from them (not taken
    from the manifest), and the blob is a hard link to the store file.  A blob of that name already there is kept
    when its bytes are that name's (another copy of the same bytes); one that is not (a link, other bytes) is
    replaced by ours.  ``known``: the name the snapshot links to now, used unhashed where it is the store file."""
    if known is not None and _same_file(store, inside(root, f"blobs/{known}")):
        return f"blobs/{known}"
    name = _name_of(store, etag)
    blob = inside(root, f"blobs/{name}")
    try:
        os.link(store, blob)
        return f"blobs/{name}"
    except FileExistsError:
        pass
    if _same_file(store, blob):
        return f"blobs/{name}"
    try:
        if not os.path.islink(blob) and _name_of(blob, etag) == name:
            return f"blobs/{name}"
    except OSError:
        pass
    _replace(blob, lambda tmp: os.link(store, tmp))
    return f"blobs/{name}"


def _replace(path: str, make) -> None:
    """Put what ``make(tmp)`` creates (a hard link, a symlink) at ``path`` by rename from a name beside it."""
    tmp = path + ".p2pw-tmp"
    if os.path.lexists(tmp):
        os.remove(tmp)
    make(tmp)
    os.replace(tmp, path)


def asked_revision(url: str | None, repo: str) -> str | None:
    """The revision a join asked for by naming ``ORG/NAME[@REVISION]`` of ``repo`` (``main`` when none is
    given), or None where it named no revision of that repo (a model id, a parent, another URL)."""
    parsed = parse_repo_ref(url) if url else None
    return parsed[1] if parsed and parsed[0] == repo else None


def ref_to_write(origin: dict, asked: str | None, current: str | None) -> str | None:
    """The ref a complete copy writes, or None.  Rules: a revision asked for is written (its name, whatever the
    manifest's says); a commit asked for, or none asked and none in the manifest, writes no ref; with none
    asked, the manifest's revision is written only where no ref of that name names another commit (a manifest
    never moves a ref the host holds)."""
    commit = origin["commit"]
    if asked is not None:
        return None if asked == commit else asked
    revision = origin.get("revision")
    if not revision or revision == commit or (current is not None and current != commit):
        return None
    return revision


def check_publishable(manifest) -> None:
    """HFCacheError unless ``manifest`` came from a hub snapshot: a repo, a commit, an etag per file."""
    o = manifest.origin or {}
    if not o.get("repo") or not COMMIT.fullmatch(o.get("commit", "")):
        raise HFCacheError("--hf-cache needs a model seeded from a Hugging Face cache (p2pw seed ORG/NAME): "
                           "this manifest names no repo and commit")
    bad = [f["name"] for f in manifest.files if not re.fullmatch(r"[\w.-]+", str(f.get("etag", ""))) or
           str(f.get("etag", "")).startswith(".") or len(str(f["etag"])) > MAX_ETAG]
    if bad:
        raise HFCacheError(f"--hf-cache: files without a usable etag in the manifest: {', '.join(bad[:5])}")
    if parse_repo_ref(o["repo"]) is None:
        raise HFCacheError(f"--hf-cache: repo id {o['repo']!r} in the manifest is not ORG/NAME")


def repo_dir(manifest, hub: str) -> str:
    check_publishable(manifest)
    return os.path.join(os.path.abspath(hub), repo_folder(manifest.origin["repo"]))


def publish(manifest, root: str, asked: str | None = None) -> str:
    """Link each blob (``place_blob``: named by its bytes), then write the snapshot symlinks, then the ref
    (``ref_to_write``; ``asked``: the revision the join asked for), of a complete copy in ``root``.

    Returns the snapshot directory.  Idempotent; each link and the ref appear by rename, the ref durably;
    every path is checked to stay inside ``root`` (``paths.inside``).
    """
    check_publishable(manifest)
    commit = manifest.origin["commit"]
    snap = inside(root, f"snapshots/{commit}")
    for f, store in zip(manifest.files, blob_names(manifest)):
        link = inside(snap, f["name"])
        os.makedirs(os.path.dirname(link), exist_ok=True)
        now = os.readlink(link) if os.path.islink(link) else None
        known = os.path.basename(now) if now and HUB_NAME.fullmatch(os.path.basename(now)) else None
        blob = place_blob(root, inside(root, store), f["etag"], known)
        target = os.path.relpath(inside(root, blob), os.path.dirname(link))
        if now == target:
            continue
        _replace(link, lambda tmp: os.symlink(target, tmp))
    ref = ref_to_write(manifest.origin, asked, _read_ref(root, manifest.origin.get("revision")))
    if ref:
        path = inside(root, f"refs/{ref}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_text_atomically(path, commit, durable=True)
    return snap


def _read_ref(root: str, revision: str | None) -> str | None:
    if not revision:
        return None
    try:
        with open(inside(root, f"refs/{revision}")) as f:
            return f.read().strip()
    except (OSError, ValueError):
        return None
