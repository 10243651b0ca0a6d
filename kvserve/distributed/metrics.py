"""/metrics over data-parallel replicas: every replica's series labelled engine="i" (vLLM's label), and their sums
labelled engine="total" (a fraction, vllm:kv_cache_usage_perc, gets the replicas' mean)."""
from __future__ import annotations

from collections import OrderedDict

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families


def merge_replica_metrics(texts: dict[int, bytes]) -> bytes:
    """One exposition of the replicas' expositions (replica index -> its /metrics text)."""
    families: OrderedDict[str, Metric] = OrderedDict()
    totals: dict[str, OrderedDict] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text.decode()):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type)
                totals[family.name] = OrderedDict()
            for s in family.samples:
                merged.add_sample(s.name, {**s.labels, "engine": str(replica)}, s.value)
                key = (s.name, tuple(sorted(s.labels.items())))
                totals[family.name][key] = totals[family.name].get(key, 0.0) + s.value
    for name, family in families.items():
        for (sample_name, labels), value in totals[name].items():
            if name.endswith("_perc"):
                value /= len(texts)
            family.add_sample(sample_name, {**dict(labels), "engine": "total"}, value)
    registry = CollectorRegistry()
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _Fixed:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families
