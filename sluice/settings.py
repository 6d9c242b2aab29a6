"""The one configuration surface, read from `SLUICE_*` environment variables.

A `Settings` object is built once by the process entry point (`sluice ...`) and passed down;
nothing reads the environment at import time. Each component takes keyword-only arguments and
`Settings` maps onto them, so tests build components directly without any environment.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SLUICE_", extra="ignore")

    # Unset means "start the embedded store" under `home` (sluice up only).
    redis_url: str | None = None
    database_url: str | None = None
    home: Path = Path(".sluice")

    api_host: str = "127.0.0.1"
    api_port: int = 8000
    flower_port: int = 5555
    metrics_port: int = 9100

    bootstrap_admin_key: SecretStr | None = None

    result_ttl_s: int = Field(default=24 * 3600, ge=60)
    idempotency_ttl_s: int = Field(default=24 * 3600, ge=60)
    claim_after_s: float = Field(default=30.0, gt=0)
    max_deliveries: int = Field(default=3, ge=1)
    routing_refresh_s: float = Field(default=30.0, gt=0)
    auth_cache_s: float = Field(default=60.0, ge=0)

    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    max_text_chars: int = Field(default=20_000, ge=1)
    max_bulk_items: int = Field(default=1000, ge=1)
    max_wait_s: float = Field(default=60.0, ge=0)

    shutdown_grace_s: float = Field(default=30.0, ge=0)
    worker_prefetch_batches: int = Field(default=4, ge=1)
    cpu_cores: int | None = None

    webhook_allowed_networks: list[str] = Field(default_factory=list)

    @field_validator("webhook_allowed_networks", mode="before")
    @classmethod
    def _split_networks(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("webhook_allowed_networks")
    @classmethod
    def _valid_networks(cls, value: list[str]) -> list[str]:
        for cidr in value:
            ipaddress.ip_network(cidr, strict=False)
        return value

    @field_validator("bootstrap_admin_key")
    @classmethod
    def _strong_admin_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 16:
            raise ValueError("SLUICE_BOOTSTRAP_ADMIN_KEY must be at least 16 characters")
        return value

    def require_redis_url(self) -> str:
        if not self.redis_url:
            raise ValueError("SLUICE_REDIS_URL is not set (only `sluice up` starts an embedded store)")
        return self.redis_url

    def require_database_url(self) -> str:
        if not self.database_url:
            raise ValueError(
                "SLUICE_DATABASE_URL is not set (only `sluice up` starts an embedded store)"
            )
        return self.database_url
