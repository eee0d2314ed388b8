#!/usr/bin/env python3
"""A plain S3 client, as a host without p2pw takes a model: boto3's transfer manager, object by object.

    python bench/s3_client.py put DIR s3://BUCKET/PREFIX    # make the bucket, upload DIR's files
    python bench/s3_client.py get s3://BUCKET/PREFIX OUT    # download every object under PREFIX into OUT

``get`` is what ``aws s3 cp --recursive`` does (the same s3transfer: parallel ranged GETs of large
objects); credentials and endpoint come the standard AWS way (``AWS_ENDPOINT_URL`` for a local server).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def split(url: str) -> tuple[str, str]:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return bucket, prefix.rstrip("/")


def put(src: str, url: str, s3) -> None:
    bucket, prefix = split(url)
    s3.create_bucket(Bucket=bucket)
    for path in sorted(Path(src).rglob("*")):
        if path.is_file():
            s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(src)}")


def get(url: str, out: str, s3) -> None:
    bucket, prefix = split(url)
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/")
    for obj in (o for page in pages for o in page.get("Contents", [])):
        dest = Path(out) / obj["Key"][len(prefix) + 1:]
        dest.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(bucket, obj["Key"], str(dest))


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("put", "get"):
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    import boto3

    s3 = boto3.client("s3", region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))
    (put if argv[0] == "put" else get)(*argv[1:], s3)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
