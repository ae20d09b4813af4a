output "repository_url" {
  description = "URL of the repository (REGISTRY/NAME): push the image to it as URL:TAG."
  value       = aws_ecr_repository.ragkv.repository_url
}

output "repository_arn" {
  description = "ARN of the repository (for scoped pull permissions)."
  value       = aws_ecr_repository.ragkv.arn
}
