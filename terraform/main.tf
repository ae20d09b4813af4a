# ragkv on AWS: the KV bucket (durable tier), the ECR repository of the image,
# the serving tier on EC2 g5, and optional Spot Batch indexing. See README.md
# for the inputs and outputs.

locals {
  tags = merge({ Project = "ragkv", ManagedBy = "terraform" }, var.tags)

  # The one image both tiers run: built from the Dockerfile, pushed to the
  # repository below under image_tag, and pulled by its digest (the tag only names it).
  container_image = join("", [
    "${module.registry.repository_url}:${var.image_tag}",
    var.image_digest == null ? "" : "@${var.image_digest}",
  ])
}

module "registry" {
  source = "./modules/registry"

  name = var.name
  # The deployed tag never expires, so the digest the hosts pull stays in the repository.
  protected_tags = [var.image_tag]
  force_delete   = var.force_destroy
  tags           = local.tags
}

module "kv_bucket" {
  source = "./modules/kv-bucket"

  name                = var.name
  bucket_name         = var.bucket_name
  kv_prefix           = var.kv_prefix
  index_prefix        = var.index_prefix
  expired_prefixes    = var.expired_prefixes
  expired_prefix_days = var.expired_prefix_days
  access_log_bucket   = var.access_log_bucket
  force_destroy       = var.force_destroy
  tags                = local.tags
}

module "serving" {
  source = "./modules/serving"
  count  = var.enable_serving ? 1 : 0

  name                              = var.name
  vpc_id                            = var.vpc_id
  subnet_ids                        = var.subnet_ids
  instance_type                     = var.instance_type
  ami_ssm_parameter                 = var.ami_ssm_parameter
  ami_id                            = var.ami_id
  container_image                   = local.container_image
  ecr_repository_arn                = module.registry.repository_arn
  detailed_monitoring               = var.detailed_monitoring
  kv_bucket_arn                     = module.kv_bucket.bucket_arn
  kv_bucket_name                    = module.kv_bucket.bucket_name
  kms_key_arn                       = module.kv_bucket.kms_key_arn
  kv_prefix                         = module.kv_bucket.kv_prefix
  index_prefix                      = module.kv_bucket.index_prefix
  index_version                     = var.index_version
  model                             = var.model
  environment                       = var.serving_environment
  api_keys_json                     = var.api_keys_json
  grpc_port                         = var.grpc_port
  metrics_port                      = var.metrics_port
  allowed_cidrs                     = var.allowed_cidrs
  allow_public_ingress              = var.allow_public_ingress
  allowed_security_group_ids        = var.allowed_security_group_ids
  instance_count                    = var.instance_count
  create_autoscaling_group          = var.create_autoscaling_group
  asg_min_size                      = var.asg_min_size
  asg_max_size                      = var.asg_max_size
  asg_desired_capacity              = var.asg_desired_capacity
  create_load_balancer              = var.create_load_balancer
  load_balancer_internal            = var.load_balancer_internal
  load_balancer_deletion_protection = var.load_balancer_deletion_protection
  certificate_arn                   = var.certificate_arn
  allow_plaintext_listeners         = var.allow_plaintext_listeners
  ray_cluster                       = var.ray_cluster
  head_instance_type                = var.head_instance_type
  ray_replicas                      = var.ray_replicas
  ray_routing                       = var.ray_routing
  ray_object_store_bytes            = var.ray_object_store_bytes
  ray_peer_tier_bytes               = var.ray_peer_tier_bytes
  http_port                         = var.http_port
  tags                              = local.tags
}

module "indexing" {
  source = "./modules/indexing"
  count  = var.enable_indexing ? 1 : 0

  name             = var.name
  vpc_id           = var.vpc_id
  subnet_ids       = var.subnet_ids
  container_image  = local.container_image
  service_role_arn = var.batch_service_role_arn
  instance_types   = var.index_instance_types
  max_vcpus        = var.index_max_vcpus
  corpus_s3_uri    = var.corpus_s3_uri
  retry_attempts   = var.index_retry_attempts
  kv_bucket_arn    = module.kv_bucket.bucket_arn
  kv_bucket_name   = module.kv_bucket.bucket_name
  kms_key_arn      = module.kv_bucket.kms_key_arn
  kv_prefix        = module.kv_bucket.kv_prefix
  index_prefix     = module.kv_bucket.index_prefix
  index_version    = var.index_version
  tags             = local.tags
}
