output "job_queue_arn" {
  description = "ARN of the Spot job queue."
  value       = aws_batch_job_queue.index.arn
}

output "job_queue_name" {
  description = "Name of the Spot job queue."
  value       = aws_batch_job_queue.index.name
}

output "compute_environment_arn" {
  description = "ARN of the SPOT compute environment."
  value       = aws_batch_compute_environment.spot.arn
}

output "index_job_definition_arn" {
  description = "ARN of the `ragkv index` job definition (submit it as an array job, one child per shard)."
  value       = aws_batch_job_definition.index.arn
}

output "merge_job_definition_arn" {
  description = "ARN of the `ragkv index merge` job definition (submit it depending on the array job)."
  value       = aws_batch_job_definition.merge.arn
}

output "job_role_arn" {
  description = "ARN of the IAM role the jobs run with."
  value       = aws_iam_role.job.arn
}

output "index_out_uri" {
  description = "Default S3 URI the jobs write the index to."
  value       = local.index_out_uri
}

output "submit_commands" {
  description = "Shell commands that run a sharded index build followed by the merge step (set N to the shard count, 2 or more)."
  value       = <<-EOT
    N=4
    ARRAY_JOB=$(aws batch submit-job --job-name ${var.name}-index \
      --job-queue ${aws_batch_job_queue.index.name} \
      --job-definition ${aws_batch_job_definition.index.arn} \
      --array-properties size=$N \
      --container-overrides "environment=[{name=SHARD_COUNT,value=$N}]" \
      --query jobId --output text)
    aws batch submit-job --job-name ${var.name}-index-merge \
      --job-queue ${aws_batch_job_queue.index.name} \
      --job-definition ${aws_batch_job_definition.merge.arn} \
      --depends-on jobId=$ARRAY_JOB \
      --container-overrides "environment=[{name=SHARD_COUNT,value=$N}]"
  EOT
}
