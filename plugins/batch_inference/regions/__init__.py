"""Regions: one job version over clusters in several regions, one ledger (docs/regions.md).

* ``deployment``: the clusters (region, how workers start, GPU prices and
  interruption rate, capacity, object store) and the egress prices between
  regions, validated; not part of the job version (I2).
* ``store``: a region's object store (S3 at an endpoint, or a path).
* ``replicas``: placement of a submitted version over the regions, and each
  shard's replica in its home region (content-addressed Parquet, digest in the
  ledger).
* ``ledger``: ``RegionLedger``, what a worker started with ``--region`` is
  given in place of the plain ledger: near shards first, steals recorded and
  priced, records read from replicas, results handed in as files.
* ``merge``: the files merged by key near the ledger, through the one
  put-if-absent and fence.
* ``lost``: a region whose store does not answer, its leases ended at once.
* ``planner``: on paper, the least bill that meets a deadline across the
  clusters, and a lost region's shards placed again.

The SQL is sql/schema/regions.sql (functions and tables) and sql/regions.sql
(named statements).
"""

from batch_inference.regions.deployment import Deployment, DeploymentError, load_deployment, parse_deployment
from batch_inference.regions.ledger import RegionLedger
from batch_inference.regions.lost import check as check_regions
from batch_inference.regions.lost import end_region
from batch_inference.regions.merge import merge_pending, merge_until
from batch_inference.regions.planner import Workload, replan, single_regions
from batch_inference.regions.planner import plan as plan_placement
from batch_inference.regions.replicas import place, report
from batch_inference.regions.store import StoreUnavailable, store_for

__all__ = ["Deployment", "DeploymentError", "RegionLedger", "StoreUnavailable", "check_regions", "end_region",
           "Workload", "load_deployment", "merge_pending", "merge_until", "parse_deployment", "place", "plan_placement",
           "replan", "report", "single_regions", "store_for"]
