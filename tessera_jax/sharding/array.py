"""``ts.array``: distributed arrays over domains."""

from tessera_jax.sharding.domain import from_domain as from_domain
