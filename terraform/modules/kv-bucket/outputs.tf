output "bucket_name" {
  description = "Name of the KV bucket."
  value       = aws_s3_bucket.kv.id
}

output "bucket_arn" {
  description = "ARN of the KV bucket."
  value       = aws_s3_bucket.kv.arn
}

output "kms_key_arn" {
  description = "ARN of the KMS key that encrypts the bucket (callers need kms:Decrypt and kms:GenerateDataKey on it)."
  value       = aws_kms_key.kv.arn
}

output "kv_prefix" {
  description = "Key prefix of the KV files."
  value       = var.kv_prefix
}

output "index_prefix" {
  description = "Key prefix of the built indexes."
  value       = var.index_prefix
}

output "kv_s3_uri" {
  description = "S3 URI of the KV tier, the value of RAGKV_KV_S3_URI and of `ragkv index --kv-store`."
  value       = "s3://${aws_s3_bucket.kv.id}/${var.kv_prefix}"
}

output "index_s3_uri" {
  description = "S3 URI under which index versions are stored (one folder per version)."
  value       = "s3://${aws_s3_bucket.kv.id}/${var.index_prefix}"
}
