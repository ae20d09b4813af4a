output "repository_url" {
  description = "URL of the repository (REGISTRY/NAME): push the image to it as URL:TAG."
  value       = aws_ecr_repository.ragkv.repository_url
}

output "repository_arn" {
  description = "ARN of the repository (for scoped pull permissions)."
  value       = aws_ecr_repository.ragkv.arn
}

output "lifecycle_policy" {
  description = "The repository's lifecycle policy (JSON): which images it may expire, and which it protects."
  value       = aws_ecr_lifecycle_policy.ragkv.policy
}
