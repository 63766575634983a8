"""Pipeline parallelism: schedules as numpy tables (`schedule`) and the shard_map tick loop (`program`)."""
