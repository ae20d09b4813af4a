output "kv_bucket_name" {
  description = "Name of the KV bucket."
  value       = module.kv_bucket.bucket_name
}

output "kv_bucket_arn" {
  description = "ARN of the KV bucket."
  value       = module.kv_bucket.bucket_arn
}

output "kms_key_arn" {
  description = "ARN of the KMS key that encrypts the KV bucket."
  value       = module.kv_bucket.kms_key_arn
}

output "kv_s3_uri" {
  description = "S3 URI of the KV tier (RAGKV_KV_S3_URI, `ragkv index --kv-store`)."
  value       = module.kv_bucket.kv_s3_uri
}

output "index_s3_uri" {
  description = "S3 URI under which index versions live."
  value       = module.kv_bucket.index_s3_uri
}

output "image_repository_url" {
  description = "ECR repository the image is pushed to (`docker push <this>:<image_tag>`)."
  value       = module.registry.repository_url
}

output "container_image" {
  description = "Image the serving hosts and the Batch jobs run (<image_repository_url>:<image_tag>)."
  value       = local.container_image
}

output "serving_security_group_id" {
  description = "Security group of the serving instances, or null when serving is disabled."
  value       = one(module.serving[*].security_group_id)
}

output "serving_instance_ids" {
  description = "IDs of the standalone serving instances."
  value       = flatten(module.serving[*].instance_ids)
}

output "serving_autoscaling_group_name" {
  description = "Name of the serving Auto Scaling group, or null."
  value       = one(module.serving[*].autoscaling_group_name)
}

output "grpc_endpoints" {
  description = "host:port addresses that clients dial (the load balancer, or each standalone instance)."
  value       = flatten(module.serving[*].grpc_endpoints)
}

output "batch_job_queue_arn" {
  description = "ARN of the Spot indexing job queue, or null when indexing is disabled."
  value       = one(module.indexing[*].job_queue_arn)
}

output "batch_index_job_definition_arn" {
  description = "ARN of the `ragkv index` job definition, or null."
  value       = one(module.indexing[*].index_job_definition_arn)
}

output "batch_merge_job_definition_arn" {
  description = "ARN of the `ragkv index merge` job definition, or null."
  value       = one(module.indexing[*].merge_job_definition_arn)
}

output "batch_submit_commands" {
  description = "Shell commands that run a sharded index build and then the merge step, or null."
  value       = one(module.indexing[*].submit_commands)
}

output "http_endpoint" {
  description = "host:port of the OpenAI-compatible HTTP API of a Ray cluster (ray_cluster), or null."
  value       = one(module.serving[*].http_endpoint)
}
