"""Regions: one job version over clusters in several regions, one ledger (docs/regions.md).

* ``deployment``: the clusters (region, how workers start, GPU prices and
  interruption rate, capacity, object store) and the egress prices between
  regions, validated; not part of the job version (I2).
* ``store``: a region's object store (S3 at an endpoint, or a path).
* ``replicas``: the stores and connections checked before a submit onto a
  deployment writes anything (``plan.submit(deployment=...)``), and the
  placement of the version over the regions, each shard's replica in its home region (content-addressed Parquet,
  digest in the ledger), what replication cost.
* ``ledger``: ``RegionLedger``, what a worker started with ``--region`` is
  given in place of the plain ledger: near shards first, steals recorded and
  priced, records read from replicas, results handed in as files.
* ``merge``: the files merged by key near the ledger, through the one
  put-if-absent and fence.
* ``lost``: a region lost (its store silent, its workers gone at once, its
  cluster unreachable), found at every poll, its leases ended at once.
* ``fleet``: one autopilot over every cluster: each cluster's size against
  the deadline at the least bill, recorded per cluster, and the steal gates
  the deadline's arithmetic opens.
* ``nights``: a compressed night over three simulated regions for the
  nights harness (``NightsConfig.regions``).
* ``planner``: on paper, the least bill that meets a deadline across the
  clusters, and a lost region's shards placed again.

The SQL is sql/schema/regions.sql (functions and tables) and sql/regions.sql
(named statements).
"""

from batch_inference.regions.deployment import Deployment, DeploymentError, load_deployment, parse_deployment
from batch_inference.regions.ledger import RegionLedger
from batch_inference.regions.fleet import ClusterPilot, cluster_seconds, decide_clusters, launcher_name, steal_gates
from batch_inference.regions.fleet import reconcile as reconcile_clusters
from batch_inference.regions.lost import check as check_regions
from batch_inference.regions.lost import end_region
from batch_inference.regions.lost import watch as watch_regions
from batch_inference.regions.nights import RegionNight, one_region_figures
from batch_inference.regions.merge import merge_pending, merge_until, merge_until_settled
from batch_inference.regions.planner import Workload, replan, single_regions
from batch_inference.regions.planner import plan as plan_placement
from batch_inference.regions.replicas import check_reachable, local_slots, place, report
from batch_inference.regions.store import StoreUnavailable, store_for

__all__ = ["Deployment", "DeploymentError", "RegionLedger", "StoreUnavailable", "check_reachable", "check_regions",
           "ClusterPilot", "cluster_seconds", "decide_clusters", "launcher_name", "reconcile_clusters",
           "steal_gates", "watch_regions", "RegionNight", "one_region_figures",
           "end_region", "local_slots",
           "Workload", "load_deployment", "merge_pending", "merge_until", "merge_until_settled", "parse_deployment",
           "place", "plan_placement",
           "replan", "report", "single_regions", "store_for"]
