"""The tiers: memory (gpu, cpu), disk and s3, each behind StorageTier's small interface."""
