"""An S3-compatible object store as the shared tier (`s3://bucket/prefix`).

Same layout and same objects as the POSIX store (shared.py), under the key prefix:
`<prefix>/ckptfs/objects/<node>/<id>.seg`, `<prefix>/ckptfs/manifests/<node>/<seq>.manifest`.
An S3 PUT and a multipart-complete are atomic, so there are no temp names: an object is
visible whole or not at all, and manifests are written after their objects. Segments upload
as multipart uploads in large parts, several parts in parallel; an upload a crash left
unfinished is aborted on the owner's next mount (`clean_temp`).

Endpoint and credentials come from the standard AWS environment variables and config files
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_PROFILE, ~/.aws/config...). boto3 retries throttling
and 5xx with backoff (standard mode); what still fails becomes an OSError, which the drain
retries like a NAS outage. All methods block: call them from worker threads.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import os
import threading
from typing import Any, Callable, Iterator

import xxhash

from ckptfs import layout
from ckptfs import segment as fmt
from ckptfs.shared import (MAN_RE, NODE_RE, OBJ_RE, RateLimiter, SharedError, Watch,
                           exists_error)

log = logging.getLogger(__name__)


class _Unsupported(OSError):
    """The server does not implement a request option (501 NotImplemented)."""

PART_SIZE = 64 << 20
READ_CHUNK = 8 << 20


def is_s3(url: str) -> bool:
    return url.startswith("s3://")


class S3Store:
    # records fetched ahead of sequential reads at once (ckptfs/reads.py; a directory store:
    # 4): each GET waits a network round trip, and 4 at a time from an endpoint 36 ms away
    # moved 50-110 MB/s (bench/README.md, 2026-12-07, night)
    fetches_ahead = 16

    def __init__(self, url: str, streams: int = 4, part_size: int = PART_SIZE):
        import boto3
        from botocore.config import Config

        if not is_s3(url):
            raise SharedError(f"not an s3:// URL: {url}")
        rest = url[5:]
        self.bucket, _, prefix = rest.partition("/")
        if not self.bucket:
            raise SharedError(f"no bucket in {url}")
        self.base = url
        self.prefix = (prefix.strip("/") + "/" if prefix.strip("/") else "") + layout.SHARED_ROOT
        self.root = f"s3://{self.bucket}/{self.prefix}"
        self.part_size = part_size
        self.streams = max(1, streams)
        from botocore.exceptions import BotoCoreError

        try:  # a missing profile, an unreadable ~/.aws/config, a malformed endpoint or region
            self.client = boto3.session.Session().client("s3", config=Config(
                retries={"mode": "standard", "max_attempts": 8},
                # uploads, reads, and the fetches ahead of sequential reads
                max_pool_connections=max(16, 4 * self.streams) + self.fetches_ahead,
                connect_timeout=5, read_timeout=60))
        except (BotoCoreError, ValueError) as e:
            raise SharedError(f"the AWS settings for {url} are not usable: {e}") from None
        self.ops: dict[str, int] = {}
        self._ops_lock = threading.Lock()
        self.watch = Watch()  # every request is a call (botocore retries inside one)
        self.bytes_uploaded = 0
        self.bytes_read = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(self.streams, "ckptfs-s3-part")
        # published objects and manifests are never replaced: PUTs carry If-None-Match: *
        # (AWS S3, MinIO, SeaweedFS), unless the server says it does not implement it
        self.no_replace = True

    # --- plumbing ---------------------------------------------------------------------------

    def _op(self, name: str, n: int = 1) -> None:
        with self._ops_lock:
            self.ops[name] = self.ops.get(name, 0) + n

    def _count(self, attr: str, n: int) -> None:
        """Add to a byte counter (parts and reads report from several threads)."""
        with self._ops_lock:
            setattr(self, attr, getattr(self, attr) + n)

    def _key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts))

    def _call(self, op: str, fn: Callable[..., Any], **kw: Any) -> Any:
        """One S3 request; failures become OSError (ENOENT for a missing key)."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        self._op(op)
        try:
            with self.watch.call(op):
                return fn(Bucket=self.bucket, **kw)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            msg = f"s3 {op} {kw.get('Key', self.bucket)}: {code or status}"
            if code in ("NoSuchKey", "404", "NotFound") or status == 404 and code != \
                    "NoSuchBucket":
                raise FileNotFoundError(errno.ENOENT, msg) from None
            if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch") \
                    or status == 403:
                raise PermissionError(errno.EACCES, msg) from None
            if code == "PreconditionFailed" or status == 412:
                raise FileExistsError(errno.EEXIST, f"{msg}: the key exists already") from None
            if code == "NotImplemented" or status == 501:
                raise _Unsupported(errno.EIO, msg) from None
            raise OSError(errno.EIO, msg) from None
        except NoCredentialsError:
            raise PermissionError(errno.EACCES, "no AWS credentials found (set "
                                  "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile)") from None
        except BotoCoreError as e:
            raise OSError(errno.EIO, f"s3 {op}: {e}") from None

    def _list(self, prefix: str, delimiter: str = "") -> Iterator[dict]:
        token = None
        while True:
            kw: dict[str, Any] = {"Prefix": prefix}
            if delimiter:
                kw["Delimiter"] = delimiter
            if token:
                kw["ContinuationToken"] = token
            page = self._call("list", self.client.list_objects_v2, **kw)
            yield page
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    # --- setup ------------------------------------------------------------------------------

    def _check_bucket(self) -> None:
        try:
            self._call("head_bucket", self.client.head_bucket)
        except FileNotFoundError:
            raise SharedError(f"bucket {self.bucket!r} does not exist at "
                              f"{self.client.meta.endpoint_url}") from None
        except PermissionError as e:
            detail = e.strerror if "credentials" in (e.strerror or "") else \
                "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
            raise SharedError(f"access to bucket {self.bucket!r} denied: {detail}") from None
        except OSError as e:
            raise SharedError(f"cannot reach {self.client.meta.endpoint_url}: "
                              f"{e.strerror}") from None

    def _read_format(self) -> dict | None:
        import json

        try:
            body = self._call("get", self.client.get_object,
                              Key=self._key(layout.SHARED_FORMAT_FILE))["Body"].read()
        except FileNotFoundError:
            return None
        try:
            found = json.loads(body)
        except ValueError:
            raise SharedError(f"{self.root}/FORMAT is unreadable") from None
        if not isinstance(found, dict) or found.get("format") != \
                layout.SHARED_FORMAT["format"] or found.get("version", 0) > 1:
            raise SharedError(f"{self.root}/FORMAT: not a ckptfs shared store this version "
                              f"can use ({found})")
        return found

    def verify(self) -> None:
        """For readers (ls, export, fsck): the bucket answers and holds a ckptfs store."""
        self._check_bucket()
        if self._read_format() is None:
            raise SharedError(f"{self.base} holds no ckptfs shared store (no {self.root})")

    def init(self) -> None:
        """Check bucket and credentials with one clear line, create the FORMAT object."""
        import json

        self._check_bucket()
        key = self._key(layout.SHARED_FORMAT_FILE)
        try:
            if self._read_format() is None:
                raise FileNotFoundError
        except FileNotFoundError:
            self._call("put", self.client.put_object, Key=key,
                       Body=(json.dumps(layout.SHARED_FORMAT) + "\n").encode())

    def exists(self) -> bool:
        try:
            self._call("head", self.client.head_object, Key=self._key(layout.SHARED_FORMAT_FILE))
            return True
        except OSError:
            return False

    def check(self) -> None:
        """Before publishing, as SharedStore.check: the store must still be there."""
        try:
            self._call("head", self.client.head_object,
                       Key=self._key(layout.SHARED_FORMAT_FILE))
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"shared store layout {self.root}/FORMAT is "
                                                  f"missing (a deleted store or bucket?)") from None

    # --- writing ----------------------------------------------------------------------------

    def object_key(self, node: str, seg: int) -> str:
        return self._key("objects", node, fmt.segment_name(seg))

    def _put_new(self, what: str, node: str, op: str, fn: Callable[..., Any],
                 **kw: Any) -> Any:
        """A PUT or multipart completion of `what` that never replaces an existing key
        (exists_error), where the server implements If-None-Match."""
        try:
            if self.no_replace:
                try:
                    return self._call(op, fn, IfNoneMatch="*", **kw)
                except _Unsupported:
                    self.no_replace = False
                    log.warning("%s does not implement conditional writes (If-None-Match): a "
                                "published object could be replaced by another NVME directory "
                                "mounted under the same node id", self.client.meta.endpoint_url)
            return self._call(op, fn, **kw)
        except FileExistsError:
            raise exists_error(what, node) from None

    def put_object(self, node: str, seg: int, src: str, limiter: RateLimiter | None = None,
                   progress: Callable[[int], None] | None = None) -> tuple[int, str]:
        key = self.object_key(node, seg)
        size = os.path.getsize(src)
        h = xxhash.xxh3_128()
        if size <= self.part_size:
            with open(src, "rb") as f:
                data = f.read()
            if limiter is not None:
                limiter.take(len(data))
            h.update(data)
            self._put_new(f"object {node}/{fmt.segment_name(seg)}", node, "put",
                          self.client.put_object, Key=key, Body=data)
            self._count("bytes_uploaded", len(data))
            if progress is not None:
                progress(len(data))
            return len(data), h.hexdigest()
        up = self._call("create_multipart", self.client.create_multipart_upload, Key=key)
        upload_id = up["UploadId"]
        try:
            parts = []
            offsets = list(range(0, size, self.part_size))

            def send(i: int, off: int) -> dict:
                with open(src, "rb") as f:
                    f.seek(off)
                    data = f.read(min(self.part_size, size - off))
                if limiter is not None:
                    limiter.take(len(data))
                r = self._call("upload_part", self.client.upload_part, Key=key,
                               UploadId=upload_id, PartNumber=i + 1, Body=data)
                self._count("bytes_uploaded", len(data))
                if progress is not None:
                    progress(len(data))
                return {"PartNumber": i + 1, "ETag": r["ETag"]}

            futs = [self._pool.submit(send, i, off) for i, off in enumerate(offsets)]
            try:
                parts = [f.result() for f in futs]
            finally:  # after a failed part, none still queued or on its way when we abort
                for f in futs:
                    f.cancel()
                concurrent.futures.wait(futs)
            self._put_new(f"object {node}/{fmt.segment_name(seg)}", node, "complete_multipart",
                          self.client.complete_multipart_upload, Key=key, UploadId=upload_id,
                          MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                self._call("abort_multipart", self.client.abort_multipart_upload, Key=key,
                           UploadId=upload_id)
            except OSError:
                pass  # the next mount's clean_temp aborts it
            raise
        with open(src, "rb") as f:  # the whole-object hash, for the caller's log
            for chunk in iter(lambda: f.read(READ_CHUNK), b""):
                h.update(chunk)
        return size, h.hexdigest()

    def prepare(self, node: str) -> None:
        """Nothing to create: S3 has no directories."""

    def put_objects(self, node: str, items: list[tuple[int, str]],
                    limiter: RateLimiter | None = None,
                    progress: Callable[[int, int], None] | None = None) -> list[int]:
        """Each object is one PUT (atomic on S3): a batch is just the objects in turn."""
        return [self.put_object(node, seg, src, limiter,
                                None if progress is None else lambda n, s=seg: progress(s, n))[0]
                for seg, src in items]

    def object_ok(self, node: str, seg: int, size: int, head: bytes = b"") -> bool:
        try:
            if self.object_size(node, seg) != size:
                return False
            if head and self.read_range(node, seg, 0, len(head)) != head:
                return False
            return fmt.parse_footer(self.read_range(node, seg, size - fmt.FOOTER_SIZE,
                                                    fmt.FOOTER_SIZE)) is not None
        except (OSError, SharedError):
            return False

    def put_manifest(self, node: str, seq: int, data: bytes) -> str:
        key = self._key("manifests", node, f"{seq:016x}.manifest")
        self._put_new(f"manifest {node}/{seq:016x}", node, "put", self.client.put_object,
                      Key=key, Body=data)
        return key

    def delete_object(self, node: str, seg: int) -> None:
        self._call("delete", self.client.delete_object, Key=self.object_key(node, seg))

    def prune_manifests(self, node: str, keep: int = 2) -> None:
        for seq in self.list_manifests(node)[:-keep]:
            self._call("delete", self.client.delete_object,
                       Key=self._key("manifests", node, f"{seq:016x}.manifest"))

    def clean_temp(self, node: str) -> int:
        """Abort multipart uploads of this node that a crash left unfinished."""
        n = 0
        prefix = self._key("objects", node) + "/"
        resp = self._call("list_multipart", self.client.list_multipart_uploads, Prefix=prefix)
        for u in resp.get("Uploads", []):
            self._call("abort_multipart", self.client.abort_multipart_upload, Key=u["Key"],
                       UploadId=u["UploadId"])
            n += 1
        return n

    # --- reading ----------------------------------------------------------------------------

    def _names(self, *parts: str) -> list[str]:
        prefix = self._key(*parts) + "/"
        out = []
        for page in self._list(prefix, "/"):
            for c in page.get("CommonPrefixes", []):
                out.append(c["Prefix"][len(prefix):].rstrip("/"))
            for c in page.get("Contents", []):
                out.append(c["Key"][len(prefix):])
        return out

    def nodes(self) -> list[str]:
        return sorted(n for n in self._names("manifests") if NODE_RE.match(n))

    def all_object_nodes(self) -> list[str]:
        return sorted(n for n in self._names("objects") if NODE_RE.match(n))

    def list_manifests(self, node: str) -> list[int]:
        return sorted(int(m.group(1), 16) for n in self._names("manifests", node)
                      if (m := MAN_RE.match(n)))

    def list_objects(self, node: str) -> list[int]:
        return sorted(int(m.group(1), 16) for n in self._names("objects", node)
                      if (m := OBJ_RE.match(n)))

    def get_manifest(self, node: str, seq: int) -> bytes:
        r = self._call("get", self.client.get_object,
                       Key=self._key("manifests", node, f"{seq:016x}.manifest"))
        return r["Body"].read()

    def read_range(self, node: str, seg: int, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        r = self._call("get_range", self.client.get_object, Key=self.object_key(node, seg),
                       Range=f"bytes={offset}-{offset + length - 1}")
        data = r["Body"].read()
        self._count("bytes_read", len(data))
        return data

    def object_size(self, node: str, seg: int) -> int:
        try:
            r = self._call("head", self.client.head_object, Key=self.object_key(node, seg))
        except FileNotFoundError:
            raise SharedError(f"object {node}/{fmt.segment_name(seg)} is missing") from None
        return int(r["ContentLength"])

    def iter_object(self, node: str, seg: int) -> Iterator[bytes]:
        size = self.object_size(node, seg)
        for off in range(0, size, READ_CHUNK):
            yield self.read_range(node, seg, off, min(READ_CHUNK, size - off))

    def close(self) -> None:
        self._pool.shutdown(wait=False)
