output "security_group_id" {
  description = "Security group of the serving instances."
  value       = aws_security_group.serving.id
}

output "iam_role_arn" {
  description = "ARN of the serving instances' IAM role."
  value       = aws_iam_role.serving.arn
}

output "instance_profile_name" {
  description = "Name of the serving instances' instance profile."
  value       = aws_iam_instance_profile.serving.name
}

output "ami_id" {
  description = "AMI the instances are launched from."
  value       = local.ami_id
}

output "instance_ids" {
  description = "IDs of the standalone instances (empty when an Auto Scaling group is used)."
  value       = aws_instance.serving[*].id
}

output "private_ips" {
  description = "Private IPs of the standalone instances (empty when an Auto Scaling group is used)."
  value       = aws_instance.serving[*].private_ip
}

output "autoscaling_group_name" {
  description = "Name of the Auto Scaling group, or null."
  value       = one(aws_autoscaling_group.serving[*].name)
}

output "load_balancer_dns_name" {
  description = "DNS name of the Network Load Balancer, or null."
  value       = one(aws_lb.serving[*].dns_name)
}

output "grpc_endpoints" {
  description = "host:port addresses clients dial: the load balancer when there is one, else each standalone instance."
  value = (
    var.create_load_balancer
    ? ["${one(aws_lb.serving[*].dns_name)}:${var.grpc_port}"]
    : var.ray_cluster ? ["${one(aws_instance.ray_head[*].private_ip)}:${var.grpc_port}"]
    : [for ip in aws_instance.serving[*].private_ip : "${ip}:${var.grpc_port}"]
  )
}

output "user_data" {
  description = "Rendered cloud-init script (for review; it holds no secrets)."
  value       = local.user_data
}

output "ray_head_private_ip" {
  description = "Private IP of the Ray head node (ray_cluster), or null."
  value       = one(aws_instance.ray_head[*].private_ip)
}

output "http_endpoint" {
  description = "host:port of the OpenAI-compatible HTTP API in a Ray cluster (the load balancer, else the head node), or null."
  value = !var.ray_cluster ? null : (
    var.create_load_balancer ? "${one(aws_lb.serving[*].dns_name)}:${var.http_port}" : "${one(aws_instance.ray_head[*].private_ip)}:${var.http_port}"
  )
}

output "ray_user_data" {
  description = "Rendered cloud-init scripts of the Ray head and workers (ray_cluster; for review, no secrets: the Ray token lives in SSM)."
  value       = var.ray_cluster ? { head = local.head_user_data, worker = local.worker_user_data } : null
}

output "api_keys_parameter_name" {
  description = "SSM SecureString that holds the API keys file the hosts read at boot (change api_keys_json, apply, then restart the replicas)."
  value       = aws_ssm_parameter.api_keys.name
}

output "writeback_s3_uri" {
  description = "S3 URI under which the serving hosts may write back KV computed at serve time (the only place they may write)."
  value       = "s3://${var.kv_bucket_name}/${local.writeback_prefix}"
}

output "metrics_host" {
  description = "Address /metrics binds on the hosts: 0.0.0.0 when the security group admits its port from inside the VPC only, else 127.0.0.1."
  value       = local.metrics_host
}
