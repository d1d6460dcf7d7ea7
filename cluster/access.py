"""Who may call what: a call's bearer token names its tenant, and the monitoring tenants
read the cluster's figures (``GetStats``, ``/metrics``).

Without a token file every caller is served, as no tenant (``None``).  With one, every
tenant may read the cluster-wide figures unless ``monitoring_tenants`` names some; the
figures per tenant (``kvserve_tenant_cached_blocks``: which tenants there are, and how much
each caches) only the tenants it names may, since they tell one tenant of the others.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.cluster.auth import AuthenticationError, Tenant, TokenTable
from kvserve.cluster.frontend_errors import PermissionDeniedError, UnauthenticatedError


@dataclass(frozen=True, slots=True)
class Access:
    tokens: TokenTable | None = None
    monitoring_tenants: frozenset[str] = frozenset()

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant of a call's ``authorization`` value; ``None`` without a token file.
        ``UnauthenticatedError`` when the server has tokens and the value is not one of them."""
        if self.tokens is None:
            return None
        try:
            return self.tokens.authenticate(authorization)
        except AuthenticationError as exc:
            raise UnauthenticatedError(str(exc)) from None

    def check_monitoring(self, tenant: Tenant | None) -> None:
        """``PermissionDeniedError`` unless ``tenant`` may read the cluster-wide figures."""
        if tenant is None or not self.monitoring_tenants or tenant.name in self.monitoring_tenants:
            return
        raise PermissionDeniedError(
            f"tenant {tenant.name!r} may not read the cluster's monitoring figures (the server's --monitoring-tenant)"
        )

    def may_read_tenants(self, tenant: Tenant | None) -> bool:
        """Whether ``tenant`` may read the figures of each tenant: a monitoring tenant named as one."""
        return tenant is None or tenant.name in self.monitoring_tenants
