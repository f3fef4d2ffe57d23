"""The index's event transport: each replica's KV events over ZMQ (its SUB or the central one),
replay and snapshot resync, applied to the index (gateway/index/). It reaches a replica only
through `followers.FollowedReplica`, never through gateway/fleet/."""
