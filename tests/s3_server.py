"""A real S3 server of the test's own: moto's, on a free local port in this process, with one bucket,
and the settings a platform needs to use it as its object store (SLUICE_OBJECT_ROOT and the
storage options s3fs takes). Nothing leaves the machine."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tests.support import unique

REGION = "us-east-1"


@dataclass(frozen=True, slots=True)
class S3Server:
    endpoint: str
    bucket: str

    @property
    def root(self) -> str:
        """The object root: a prefix in the bucket, so the rest of the bucket is outside it."""
        return f"s3://{self.bucket}/sluice"

    @property
    def options(self) -> dict[str, Any]:
        return {"key": "testing", "secret": "testing",
                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": REGION}}

    @property
    def env(self) -> dict[str, str]:
        """What a `sluice api` or `sluice worker` process needs to use it."""
        return {"SLUICE_OBJECT_ROOT": self.root, "SLUICE_OBJECT_STORAGE_OPTIONS": json.dumps(self.options)}

    @property
    def settings(self) -> dict[str, str]:
        """The same as Settings fields, for an API built in process."""
        return {"object_root": self.root, "object_storage_options": json.dumps(self.options)}

    def tenant_url(self, tenant: str, name: str) -> str:
        return f"{self.root}/tenants/{tenant}/{name}"

    def filesystem(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.options)


@contextmanager
def s3_server() -> Iterator[S3Server]:
    """moto's server, its bucket made through boto3 (s3fs' `mkdir` asks for a region constraint moto
    refuses in us-east-1), stopped on exit."""
    import boto3
    from moto.server import ThreadedMotoServer

    # Its request log is werkzeug's: one line per request is noise in a failed test's output.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        s3 = S3Server(endpoint=f"http://{host}:{port}", bucket=unique("sluice-objects"))
        boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name=REGION).create_bucket(Bucket=s3.bucket)
        yield s3
    finally:
        server.stop()
