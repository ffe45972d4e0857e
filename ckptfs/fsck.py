"""fsck of the shared store: are the manifests valid, and is every byte they name there?

Checks, per node: the newest manifest parses; every object it
names exists with the size the manifest records, ends in a valid footer and record table;
every extent points at a WRITE record of that table whose length matches. --deep also reads
every record of every referenced object and verifies its checksum. Objects no manifest
references are reported (they are garbage, or the drain of a live node is ahead of its
manifest), and so is an object name found in two places on a directory store (beside the
batch directories and in one, or in two).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ckptfs import manifest
from ckptfs import segment as fmt
from ckptfs.shared import SharedStore


@dataclass
class FsckReport:
    nodes: int = 0
    manifests: int = 0
    files: int = 0
    objects: int = 0
    bytes_verified: int = 0
    problems: list[str] = field(default_factory=list)
    unreferenced: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def fsck(store: SharedStore, deep: bool = False,
         progress: Callable[[str], None] | None = None) -> FsckReport:
    rep = FsckReport()
    from ckptfs.export import Resolver

    referenced: dict[str, dict[tuple[int, int], str]] = {}
    parsed: dict[str, manifest.Manifest] = {}
    sizes: dict[str, int] = {}
    for node in store.nodes():
        rep.nodes += 1
        seqs = store.list_manifests(node)
        if not seqs:
            continue
        seq = seqs[-1]
        where = f"{node}/{seq:016x}.manifest"
        try:
            m = manifest.parse(store.get_manifest(node, seq), where)
        except (OSError, manifest.ManifestError) as e:
            rep.problems.append(str(e))
            continue
        if m.node != node:
            rep.problems.append(f"{where}: claims to be from node {m.node!r}")
            continue
        rep.manifests += 1
        parsed[node] = m
        for obj, info in m.objects.items():
            if isinstance(info, dict) and isinstance(info.get("size"), int):
                sizes[obj] = info["size"]
        for e in m.files():
            rep.files += 1
            for _off, length, obj, pos, _skip, rec_len in e.extents:
                referenced.setdefault(obj, {}).setdefault((pos, rec_len),
                                                          f"{where}: {e.path}")
    where_is = Resolver(store, parsed)
    for obj, uses in sorted(referenced.items()):
        node, seg = manifest.split_obj(obj)
        if progress:
            progress(obj)
        rep.objects += 1
        try:
            size = where_is.object_size(node, seg)
        except Exception as e:
            rep.problems.append(f"{obj}: {e}")
            continue
        if obj in sizes and sizes[obj] != size:
            rep.problems.append(f"{obj}: size {size} but the manifest says {sizes[obj]}")
            continue
        try:
            sealed = fmt.SealedSegment(obj, size, lambda o, n, nd=node, sg=seg:
                                       where_is.read_range(nd, sg, o, n))
        except (OSError, fmt.CorruptRecord) as e:
            rep.problems.append(f"{obj}: {e}")
            continue
        rows = {r[0]: r for r in sealed.rows}
        for (pos, rec_len), user in sorted(uses.items()):
            row = rows.get(pos)
            if row is None or row[1] not in fmt.DATA_TYPES or row[2] != rec_len:
                rep.problems.append(f"{user}: an extent names no data record of length "
                                    f"{rec_len} at offset {pos} of object {obj}")
        if deep:
            for row in sealed.rows:
                try:
                    sealed.record(row, with_payload=True)
                    rep.bytes_verified += row[2]
                except fmt.CorruptRecord as e:
                    rep.problems.append(str(e))
                except OSError as e:
                    rep.problems.append(f"{obj}: {e}")
                    break
    for node in store.all_object_nodes():
        if hasattr(store, "duplicate_objects"):  # a directory store: batch directories
            for seg, paths in sorted(store.duplicate_objects(node).items()):
                rep.problems.append(f"{manifest.obj_name(node, seg)}: published more than "
                                    f"once ({', '.join(paths)})")
        for seg in store.list_objects(node):
            obj = manifest.obj_name(node, seg)
            if obj not in referenced:
                rep.unreferenced.append(obj)
    return rep
