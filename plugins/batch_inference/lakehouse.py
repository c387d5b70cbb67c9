"""The Iceberg catalog and warehouse that both the Iceberg source (``sources.iceberg``) and the Iceberg
destination (``destinations.iceberg``) open, from a ``spec.Destination``'s catalog settings.

Catalogs: ``sql`` (pyiceberg's SqlCatalog on PostgreSQL: by default the ledger's own database, its tables
in schema ``iceberg_catalog``), ``rest`` and ``glue`` (pyiceberg's clients). The warehouse is a local path
or ``s3://``. Credentials are never in the spec: Glue's and S3's come from the Airflow AWS connection the
settings name (``aws_conn_id``, resolved by the amazon provider's hook, lazily: Airflow is imported only
then), else from the environment, as boto3 and pyarrow read it. pyiceberg, pyarrow and SQLAlchemy are
imported where they are used: a job that names no Iceberg table needs none of them.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import urlsplit

import psycopg

from batch_inference.db import q
from batch_inference.exceptions import DestinationRefused, DestinationUnavailable
from batch_inference.spec import Destination as DestinationSpec


def first_line(exc: BaseException, *secrets: str) -> str:
    """The first line of an error, every secret and URL password as ``***``, at most 300 characters."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return re.sub(r"(//[^/@\s]*:)[^/@\s]*@", r"\1***@", text)[:300]


# -- AWS credentials from an Airflow connection ---------------------------------

def aws_connection(conn_id: str, region: str | None, name: str) -> dict[str, str]:
    """The credentials, region and endpoints of the Airflow AWS connection ``conn_id``, resolved by the
    amazon provider's hook (so whatever that connection does, an assumed role included, applies): keys
    ``access_key``, ``secret_key``, ``token``, ``region``, ``glue_endpoint``, ``s3_endpoint`` (empty when
    not set). Airflow is imported here, and only when a destination names a connection. Airflow masks the
    secret key and token in task logs; the adapter keeps them out of its own error lines."""
    try:
        from airflow.providers.amazon.aws.hooks.base_aws import AwsGenericHook
    except ImportError:
        raise DestinationUnavailable(f"{name}: aws_conn_id {conn_id!r} needs Airflow's amazon provider "
                                     "(pip install 'airflow-provider-batch-inference[airflow]')") from None
    try:
        hook = AwsGenericHook(aws_conn_id=conn_id, client_type="glue", region_name=region)
        hook.get_connection(conn_id)   # one that is not defined is refused: the hook would use the environment's
        if hook.get_session(region_name=region).get_credentials() is None:
            raise DestinationUnavailable(f"{name}: Airflow connection {conn_id!r} has no AWS credentials "
                                         "(nor does the environment)")
        creds = hook.get_credentials(region_name=region)
        wrapper = hook.conn_config
        return {"access_key": creds.access_key, "secret_key": creds.secret_key, "token": creds.token or "",
                "region": region or wrapper.region_name or "",
                "glue_endpoint": wrapper.get_service_endpoint_url("glue") or "",
                "s3_endpoint": wrapper.get_service_endpoint_url("s3") or ""}
    except DestinationUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - an unknown connection, an STS refusal: one line
        raise DestinationUnavailable(f"{name}: Airflow connection {conn_id!r}: {first_line(exc)}") from None


class CatalogAccess:
    """The catalog, warehouse filesystem and credentials of one ``spec.Destination`` (``kind: iceberg``),
    each made once; error lines never show a password or secret key."""

    def __init__(self, dest: DestinationSpec, *, ledger: psycopg.Connection | None = None):
        self.dest = dest
        self.name = dest.name
        self._ledger = ledger
        self._secrets: list[str] = []     # what an error line must never show (a password, a secret key)
        self._aws_settings: dict[str, str] | None = None
        self._catalog_obj: Any = None

    def error_line(self, exc: BaseException) -> str:
        return first_line(exc, *self._secrets)

    # -- where things are
    @property
    def warehouse(self) -> str:
        w = self.dest.warehouse
        return w if "://" in w else "file://" + os.path.abspath(w)

    def aws(self) -> dict[str, str]:
        """The destination's Airflow AWS connection (``aws_conn_id``), resolved once; {} without one
        (pyiceberg, boto3 and pyarrow then read the environment)."""
        if self._aws_settings is None:
            self._aws_settings = (aws_connection(self.dest.aws_conn_id, self.dest.s3_region, self.name)
                                  if self.dest.aws_conn_id else {})
            self._secrets += [v for k, v in self._aws_settings.items() if k in ("secret_key", "token") and v]
        return self._aws_settings

    def s3_endpoint(self) -> str | None:
        return self.dest.s3_endpoint or self.aws().get("s3_endpoint") or None

    def region(self) -> str | None:
        return self.dest.s3_region or self.aws().get("region") or None

    def io_properties(self) -> dict[str, str]:
        props: dict[str, str] = {}
        if endpoint := self.s3_endpoint():
            props["s3.endpoint"] = endpoint
        if region := self.region():
            props["s3.region"] = region
        return {**props, **self.aws_keys("s3")}

    def aws_keys(self, prefix: str) -> dict[str, str]:
        """The connection's credentials as pyiceberg's ``<prefix>.access-key-id`` ... properties."""
        aws = self.aws()
        names = {"access_key": "access-key-id", "secret_key": "secret-access-key", "token": "session-token"}
        return {f"{prefix}.{p}": aws[k] for k, p in names.items() if aws.get(k)}

    def filesystem(self) -> Any:
        """The pyarrow filesystem of the warehouse; S3 credentials from the Airflow connection, else the
        environment."""
        from pyarrow import fs

        if self.warehouse.startswith("s3://"):
            kw: dict[str, Any] = {}
            if endpoint := self.s3_endpoint():
                parts = urlsplit(endpoint)
                kw["endpoint_override"] = parts.netloc
                kw["scheme"] = parts.scheme or "https"
            if region := self.region():
                kw["region"] = region
            aws = self.aws()
            if aws.get("access_key"):
                kw.update(access_key=aws["access_key"], secret_key=aws["secret_key"],
                          session_token=aws.get("token") or None)
            return fs.S3FileSystem(**kw)
        return fs.LocalFileSystem()

    @staticmethod
    def fs_path(uri: str) -> str:
        """A table URI as the pyarrow filesystem names it (no scheme)."""
        return uri.split("://", 1)[1] if "://" in uri else uri

    def sql_uri(self) -> str:
        from sqlalchemy.engine import URL

        schema = self.dest.catalog.db_schema
        if self.dest.catalog.uri:
            base = self.dest.catalog.uri
            sep = "&" if "?" in base else "?"
            return f"{base}{sep}options=-csearch_path%3D{schema}"
        if self._ledger is None:
            raise DestinationUnavailable(f"{self.name}: no catalog.uri and no ledger connection to hold the "
                                         "catalog")
        present = self._ledger.execute(q("schema_exists"), {"schema": schema}).fetchone()["present"]
        if not present:
            raise DestinationUnavailable(f"{self.name}: schema {schema} does not exist in the ledger's database "
                                         "(migration 0015 makes iceberg_catalog; another name must be made first)")
        params = {k: v for k, v in self._ledger.info.get_parameters().items() if v}
        password = self._ledger.info.password
        if password:
            params["password"] = password
            self._secrets.append(password)
        params["options"] = f"-csearch_path={schema}"
        params.pop("sslcertmode", None)
        return URL.create("postgresql+psycopg", query=params).render_as_string(hide_password=False)

    def catalog(self) -> Any:
        """The pyiceberg catalog (made once)."""
        if self._catalog_obj is not None:
            return self._catalog_obj
        c = self.dest.catalog
        props = {"warehouse": self.warehouse, **self.io_properties()}
        try:
            if c.type == "sql":
                from pyiceberg.catalog.sql import SqlCatalog

                self._catalog_obj = SqlCatalog(c.name, uri=self.sql_uri(), **props)
            elif c.type == "rest":
                from pyiceberg.catalog.rest import RestCatalog

                self._catalog_obj = RestCatalog(c.name, uri=c.uri or "", **props)
            else:
                from pyiceberg.catalog.glue import GlueCatalog

                if region := self.region():
                    props["glue.region"] = region
                if endpoint := c.uri or self.aws().get("glue_endpoint"):
                    props["glue.endpoint"] = endpoint
                self._catalog_obj = GlueCatalog(c.name, **props, **self.aws_keys("glue"))
        except (DestinationUnavailable, DestinationRefused):
            raise
        except Exception as exc:  # noqa: BLE001 - every client's own errors: one line, retryable
            raise DestinationUnavailable(f"{self.name}: catalog unreachable: {self.error_line(exc)}"
                                         ) from None
        return self._catalog_obj

    def close(self) -> None:
        if self._catalog_obj is not None:
            self._catalog_obj.close()
            self._catalog_obj = None
