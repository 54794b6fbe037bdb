"""What rlvr writes and reads back: checkpoints, the adapter bucket, DiLoCo's round files, metrics and trackers.
Everything read here is untrusted: manifests name fixed payload files, sizes and digests are checked, no pickle."""
