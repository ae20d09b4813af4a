# The serving tier: GPU instances that run `ragkv serve` under systemd, with
# the local NVMe instance store as the disk tier and the KV bucket as the
# durable tier. Standalone instances by default; an Auto Scaling group and a
# Network Load Balancer for several replicas are optional. With ray_cluster the
# same instances form a Ray cluster instead: a head node runs `ragkv serve
# --replicas` (Ray Serve), the Auto Scaling group's GPU instances are its workers,
# and requests are routed by the chunks each replica holds.

data "aws_partition" "current" {}
data "aws_region" "current" {}
data "aws_caller_identity" "current" {}

data "aws_ssm_parameter" "ami" {
  count = var.ami_id == null ? 1 : 0
  name  = var.ami_ssm_parameter
}

# The VPC's CIDR blocks: the metrics port listens beyond loopback only when every client
# CIDR admitted to it lies inside them.
data "aws_vpc" "this" {
  id = var.vpc_id
}

locals {
  ami_id = var.ami_id != null ? var.ami_id : data.aws_ssm_parameter.ami[0].insecure_value

  partition  = data.aws_partition.current.partition
  region     = data.aws_region.current.name
  account_id = data.aws_caller_identity.current.account_id

  kv_s3_uri        = "s3://${var.kv_bucket_name}/${var.kv_prefix}"
  index_s3_uri     = "s3://${var.kv_bucket_name}/${var.index_prefix}/${var.index_version}"
  writeback_prefix = coalesce(var.writeback_prefix, "${var.kv_prefix}/serve-writeback")

  # /metrics binds 0.0.0.0 only when the security group admits its port from inside the VPC
  # alone (client CIDRs within the VPC's blocks, or security groups); else it stays on loopback
  # and the port gets no ingress rule.
  vpc_cidrs = distinct(concat([data.aws_vpc.this.cidr_block], [for a in data.aws_vpc.this.cidr_block_associations : a.cidr_block]))
  metrics_in_vpc = !var.allow_public_ingress && alltrue([
    for c in var.allowed_cidrs : anytrue([
      for v in local.vpc_cidrs :
      tonumber(split("/", c)[1]) >= tonumber(split("/", v)[1]) && cidrhost("${cidrhost(c, 0)}/${split("/", v)[1]}", 0) == cidrhost(v, 0)
    ])
  ])
  metrics_host = local.metrics_in_vpc ? "0.0.0.0" : "127.0.0.1"

  # The API keys file: an SSM SecureString under the tier's own KMS key, fetched at boot into
  # /etc/ragkv/api-keys.json (mode 0400, the container's user) and passed by path.
  api_keys_parameter     = "/${var.name}/api-keys"
  api_keys_parameter_arn = "arn:${local.partition}:ssm:${local.region}:${local.account_id}:parameter${local.api_keys_parameter}"

  user_data = templatefile("${path.module}/templates/user_data.sh.tftpl", {
    image              = var.container_image
    registry           = split("/", var.container_image)[0]
    grpc_port          = var.grpc_port
    metrics_port       = var.metrics_port
    metrics_host       = local.metrics_host
    health_port        = var.health_port
    region             = local.region
    kv_s3_uri          = local.kv_s3_uri
    index_s3_uri       = local.index_s3_uri
    model              = var.model
    api_keys_parameter = local.api_keys_parameter
    environment        = var.environment
    health_bridge      = file("${path.module}/templates/grpc_health_http.py")
  })

  # A Ray cluster: the head's and the workers' user data (templates/ray_node.sh.tftpl).
  token_parameter     = "/${var.name}/ray-auth-token"
  token_parameter_arn = "arn:${local.partition}:ssm:${local.region}:${local.account_id}:parameter${local.token_parameter}"
  ray_node = {
    image              = var.container_image
    registry           = split("/", var.container_image)[0]
    region             = local.region
    kv_s3_uri          = local.kv_s3_uri
    index_s3_uri       = local.index_s3_uri
    model              = var.model
    environment        = var.environment
    token_parameter    = local.token_parameter
    token_key          = aws_kms_key.secrets.arn
    api_keys_parameter = local.api_keys_parameter
    ray_port           = var.ray_port
    replicas           = var.ray_replicas
    routing            = var.ray_routing
    object_store_bytes = var.ray_object_store_bytes
    peer_tier          = var.ray_peer_tier_bytes > 0 ? "--peer-tier on --peer-tier-bytes ${var.ray_peer_tier_bytes}" : "--peer-tier off"
    grpc_port          = var.grpc_port
    http_port          = var.http_port
    metrics_port       = var.metrics_port
    metrics_host       = local.metrics_host
    ray_ports          = local.ray_ports_flags
  }
  # Ray's ports, fixed on every node so the security group names them (not every port):
  # GCS, node manager, object manager, dashboard agent (gRPC, HTTP), metrics, runtime env
  # agent, then the workers' range.
  ray_fixed_ports = {
    node_manager           = var.ray_port + 1, object_manager = var.ray_port + 2, dashboard_agent_grpc = var.ray_port + 3,
    dashboard_agent_listen = var.ray_port + 4, metrics_export = var.ray_port + 5, runtime_env_agent = var.ray_port + 6,
  }
  ray_port_ranges = {
    gcs_and_agents = { from = var.ray_port, to = var.ray_port + 6 }
    workers        = { from = 10002, to = 19999 }
  }
  ray_ports_flags = join(" ", concat(
    [for name, port in local.ray_fixed_ports : "--${replace(name, "_", "-")}-port ${port}"],
    ["--min-worker-port 10002", "--max-worker-port 19999"],
  ))
  head_user_data = templatefile("${path.module}/templates/ray_node.sh.tftpl", merge(local.ray_node, {
    role = "head", head_address = ""
  }))
  worker_user_data = var.ray_cluster ? templatefile("${path.module}/templates/ray_node.sh.tftpl", merge(local.ray_node, {
    role = "worker", head_address = aws_instance.ray_head[0].private_ip
  })) : ""

  use_asg          = var.create_autoscaling_group || var.ray_cluster
  standalone_count = local.use_asg ? 0 : var.instance_count

  # Ingress to the instances: metrics (when it listens beyond loopback) from the named CIDRs and
  # security groups; gRPC (and a cluster's HTTP API) from them only when there is no load
  # balancer: behind one, clients reach the API through its TLS listeners alone, never the
  # instances' plaintext ports (the load balancer's own group admits them). Keys are indexes,
  # not values, so ids unknown at plan time still work.
  client_ports = merge(
    var.create_load_balancer ? {} : { grpc = var.grpc_port },
    local.metrics_in_vpc ? { metrics = var.metrics_port } : {},
    var.ray_cluster && !var.create_load_balancer ? { http = var.http_port } : {},
  )
  cidr_ingress = merge([
    for port_name, port in local.client_ports : {
      for i, cidr in var.allowed_cidrs : "${port_name}-cidr-${i}" => { port = port, cidr = cidr, what = port_name }
    }
  ]...)
  sg_ingress = merge([
    for port_name, port in local.client_ports : {
      for i, sg in var.allowed_security_group_ids : "${port_name}-sg-${i}" => { port = port, sg = sg, what = port_name }
    }
  ]...)
  lb_ports = !var.create_load_balancer ? {} : (
    var.ray_cluster ? { grpc = var.grpc_port, http = var.http_port } : { grpc = var.grpc_port, health = var.health_port }
  )
}

# --- Secrets: the API keys file, in SSM under the tier's own KMS key ---

resource "aws_kms_key" "secrets" {
  description             = "${var.name}: encrypts the serving tier's API keys parameter"
  enable_key_rotation     = true
  deletion_window_in_days = var.kms_deletion_window_days

  # Administration stays with the account; use is granted by the instance roles'
  # policies, which name this key and only through SSM.
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Sid       = "AccountAdministersKey"
      Effect    = "Allow"
      Principal = { AWS = "arn:${local.partition}:iam::${local.account_id}:root" }
      Action    = "kms:*"
      Resource  = "*"
    }]
  })

  tags = var.tags
}

resource "aws_kms_alias" "secrets" {
  name          = "alias/${var.name}-serving-secrets"
  target_key_id = aws_kms_key.secrets.key_id
}

# The hosts read it at boot (ragkv-api-keys) into a file only the container's user reads and
# pass it by path (`ragkv serve --api-keys`): the keys never travel in user data.
resource "aws_ssm_parameter" "api_keys" {
  name        = local.api_keys_parameter
  description = "ragkv API keys file (`ragkv serve --api-keys`) of ${var.name}"
  type        = "SecureString"
  key_id      = aws_kms_key.secrets.arn
  tier        = nonsensitive(length(var.api_keys_json)) > 4096 ? "Advanced" : "Standard"
  value       = var.api_keys_json

  tags = var.tags
}

# --- IAM: least privilege on the KV prefix, read-only on the index prefix ---

locals {
  # What every serving host (and the Ray head) may do.
  host_statements = [
    {
      # Reads of every KV file; no DeleteObject: a host cannot remove what another wrote.
      Sid      = "ReadKV"
      Effect   = "Allow"
      Action   = ["s3:GetObject"]
      Resource = "${var.kv_bucket_arn}/${var.kv_prefix}/*"
    },
    {
      # Write-backs of KV computed at serve time, only under the serving tier's own prefix.
      Sid      = "WriteBackKV"
      Effect   = "Allow"
      Action   = ["s3:PutObject", "s3:AbortMultipartUpload"]
      Resource = "${var.kv_bucket_arn}/${local.writeback_prefix}/*"
    },
    {
      Sid      = "ReadIndex"
      Effect   = "Allow"
      Action   = ["s3:GetObject"]
      Resource = "${var.kv_bucket_arn}/${var.index_prefix}/*"
    },
    {
      # Unconditional: without s3:ListBucket S3 answers a missing key with 403,
      # not 404, and every KV miss would be logged and counted as an error.
      Sid      = "ListBucket"
      Effect   = "Allow"
      Action   = ["s3:ListBucket"]
      Resource = var.kv_bucket_arn
    },
    {
      Sid      = "UseBucketKey"
      Effect   = "Allow"
      Action   = ["kms:Decrypt", "kms:GenerateDataKey"]
      Resource = var.kms_key_arn
    },
    {
      Sid      = "PullImage"
      Effect   = "Allow"
      Action   = ["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer", "ecr:BatchCheckLayerAvailability"]
      Resource = var.ecr_repository_arn
    },
    {
      # `docker login` to ECR; this action takes no resource but "*".
      Sid      = "RegistryLogin"
      Effect   = "Allow"
      Action   = ["ecr:GetAuthorizationToken"]
      Resource = "*"
    },
    {
      # The API keys file: this one parameter, decrypted with its own key through SSM only.
      Sid      = "ReadApiKeys"
      Effect   = "Allow"
      Action   = ["ssm:GetParameter"]
      Resource = local.api_keys_parameter_arn
    },
    {
      Sid       = "DecryptApiKeys"
      Effect    = "Allow"
      Action    = ["kms:Decrypt"]
      Resource  = aws_kms_key.secrets.arn
      Condition = { StringEquals = { "kms:ViaService" = "ssm.${local.region}.amazonaws.com" } }
    },
  ]

  # Session Manager without AmazonSSMManagedInstanceCore (which may read every SSM
  # parameter of the account): the agent's registration and its session channels only.
  session_manager_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        # The agent registers its own instance.
        Sid      = "SessionManagerRegister"
        Effect   = "Allow"
        Action   = ["ssm:UpdateInstanceInformation"]
        Resource = "arn:${local.partition}:ec2:${local.region}:${local.account_id}:instance/*"
      },
      {
        # Session channels and agent messages: these actions take no resource but "*".
        Sid    = "SessionManagerChannels"
        Effect = "Allow"
        Action = [
          "ssmmessages:CreateControlChannel", "ssmmessages:CreateDataChannel",
          "ssmmessages:OpenControlChannel", "ssmmessages:OpenDataChannel",
          "ec2messages:AcknowledgeMessage", "ec2messages:DeleteMessage", "ec2messages:FailMessage",
          "ec2messages:GetEndpoint", "ec2messages:GetMessages", "ec2messages:SendReply",
        ]
        Resource = "*"
      },
    ]
  })
}

resource "aws_iam_role" "serving" {
  name_prefix = "${var.name}-serving-"
  description = "ragkv serving instances"

  assume_role_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "ec2.amazonaws.com" }
      Action    = "sts:AssumeRole"
    }]
  })

  tags = var.tags
}

resource "aws_iam_role_policy" "kv_access" {
  name = "ragkv-kv-access"
  role = aws_iam_role.serving.id

  policy = jsonencode({
    Version = "2012-10-17"
    Statement = concat(local.host_statements, var.ray_cluster ? [{
      # A Ray worker only reads the cluster's token; the head alone writes it.
      Sid      = "ReadRayToken"
      Effect   = "Allow"
      Action   = ["ssm:GetParameter"]
      Resource = local.token_parameter_arn
    }] : [])
  })
}

resource "aws_iam_instance_profile" "serving" {
  name_prefix = "${var.name}-serving-"
  role        = aws_iam_role.serving.name

  tags = var.tags
}

# The Ray head's own role: what a host may do, plus writing the cluster's token once.
resource "aws_iam_role" "ray_head" {
  count = var.ray_cluster ? 1 : 0

  name_prefix = "${var.name}-ray-head-"
  description = "ragkv Ray head node"

  assume_role_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "ec2.amazonaws.com" }
      Action    = "sts:AssumeRole"
    }]
  })

  tags = var.tags
}

resource "aws_iam_role_policy" "ray_head" {
  count = var.ray_cluster ? 1 : 0

  name = "ragkv-ray-head"
  role = aws_iam_role.ray_head[0].id

  policy = jsonencode({
    Version = "2012-10-17"
    Statement = concat(local.host_statements, [{
      Sid      = "WriteRayToken"
      Effect   = "Allow"
      Action   = ["ssm:GetParameter", "ssm:PutParameter"]
      Resource = local.token_parameter_arn
      }, {
      # the token is encrypted under the tier's own key, through SSM only
      Sid       = "EncryptRayToken"
      Effect    = "Allow"
      Action    = ["kms:Encrypt", "kms:GenerateDataKey"]
      Resource  = aws_kms_key.secrets.arn
      Condition = { StringEquals = { "kms:ViaService" = "ssm.${local.region}.amazonaws.com" } }
    }])
  })
}

# The Ray cluster's token: a SecureString made here under the tier's own KMS key (not the
# account's default aws/ssm key), holding a placeholder that Terraform never reads back; the
# head writes the token itself on first boot (so it is in no plan, state or user data), and
# the workers wait for it.
resource "aws_ssm_parameter" "ray_token" {
  count = var.ray_cluster ? 1 : 0

  name        = local.token_parameter
  description = "Ray token (RAY_AUTH_TOKEN) of ${var.name}'s Ray cluster: written by its head node on first boot"
  type        = "SecureString"
  key_id      = aws_kms_key.secrets.arn
  value       = "unset"

  lifecycle {
    ignore_changes = [value]
  }

  tags = var.tags
}

resource "aws_iam_instance_profile" "ray_head" {
  count = var.ray_cluster ? 1 : 0

  name_prefix = "${var.name}-ray-head-"
  role        = aws_iam_role.ray_head[0].name

  tags = var.tags
}

resource "aws_iam_role_policy" "session_manager" {
  for_each = var.enable_ssm ? merge({ serving = aws_iam_role.serving.id }, var.ray_cluster ? { ray_head = aws_iam_role.ray_head[0].id } : {}) : {}

  name   = "ragkv-session-manager"
  role   = each.value
  policy = local.session_manager_policy
}

# --- Network ---

resource "aws_security_group" "serving" {
  name_prefix = "${var.name}-serving-"
  description = "ragkv serving instances: gRPC and metrics from named clients only"
  vpc_id      = var.vpc_id

  tags = merge(var.tags, { Name = "${var.name}-serving" })

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "cidr" {
  for_each = local.cidr_ingress

  security_group_id = aws_security_group.serving.id
  description       = "ragkv ${each.value.what} from ${each.value.cidr}"
  ip_protocol       = "tcp"
  from_port         = each.value.port
  to_port           = each.value.port
  cidr_ipv4         = each.value.cidr

  tags = var.tags
}

resource "aws_vpc_security_group_ingress_rule" "sg" {
  for_each = local.sg_ingress

  security_group_id            = aws_security_group.serving.id
  description                  = "ragkv ${each.value.what} from a client security group"
  ip_protocol                  = "tcp"
  from_port                    = each.value.port
  to_port                      = each.value.port
  referenced_security_group_id = each.value.sg

  tags = var.tags
}

resource "aws_vpc_security_group_ingress_rule" "from_lb" {
  for_each = local.lb_ports

  security_group_id            = aws_security_group.serving.id
  description                  = "ragkv ${each.key} from the load balancer"
  ip_protocol                  = "tcp"
  from_port                    = each.value
  to_port                      = each.value
  referenced_security_group_id = aws_security_group.lb[0].id

  tags = var.tags
}

# A Ray cluster's nodes talk to each other on Ray's ports (GCS, node and object managers,
# agents, workers): only inside this security group, never from a client CIDR. The object
# manager's port carries the peer tier's chunk KV between replicas.
resource "aws_vpc_security_group_ingress_rule" "ray_internal" {
  for_each = var.ray_cluster ? local.ray_port_ranges : {}

  security_group_id            = aws_security_group.serving.id
  description                  = "Ray ${each.key} between the cluster's nodes"
  ip_protocol                  = "tcp"
  from_port                    = each.value.from
  to_port                      = each.value.to
  referenced_security_group_id = aws_security_group.serving.id

  tags = var.tags
}

resource "aws_vpc_security_group_egress_rule" "ray_internal" {
  for_each = var.ray_cluster ? local.ray_port_ranges : {}

  security_group_id            = aws_security_group.serving.id
  description                  = "Ray ${each.key} between the cluster's nodes"
  ip_protocol                  = "tcp"
  from_port                    = each.value.from
  to_port                      = each.value.to
  referenced_security_group_id = aws_security_group.serving.id

  tags = var.tags
}

resource "aws_vpc_security_group_egress_rule" "serving" {
  for_each = { for pair in setproduct([80, 443], var.egress_cidrs) : "${pair[0]}-${pair[1]}" => { port = pair[0], cidr = pair[1] } }

  security_group_id = aws_security_group.serving.id
  description       = "HTTP(S) to S3, KMS, SSM and package mirrors"
  ip_protocol       = "tcp"
  from_port         = each.value.port
  to_port           = each.value.port
  cidr_ipv4         = each.value.cidr

  tags = var.tags
}

# --- Instances ---

resource "aws_instance" "serving" {
  count = local.standalone_count

  ami                    = local.ami_id
  instance_type          = var.instance_type
  subnet_id              = var.subnet_ids[count.index % length(var.subnet_ids)]
  vpc_security_group_ids = [aws_security_group.serving.id]
  iam_instance_profile   = aws_iam_instance_profile.serving.name
  ebs_optimized          = true
  monitoring             = var.detailed_monitoring
  user_data_base64       = base64gzip(local.user_data)
  # User data runs on first boot only: a new image or index_version needs a
  # new instance (a stop and start would keep the old settings and wipe the
  # NVMe tier anyway).
  user_data_replace_on_change = true

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "disabled"
  }

  root_block_device {
    volume_type           = "gp3"
    volume_size           = var.root_volume_size_gb
    encrypted             = true
    kms_key_id            = var.root_volume_kms_key_id
    delete_on_termination = true
    tags                  = var.tags
  }

  tags = merge(var.tags, { Name = "${var.name}-serving-${count.index}" })

  lifecycle {
    # The SSM parameter moves to each new AMI release; replacing a serving
    # instance must be a deliberate act (taint it, or use the ASG's refresh).
    ignore_changes = [ami]
  }
}

resource "aws_instance" "ray_head" {
  count = var.ray_cluster ? 1 : 0

  ami                         = local.ami_id
  instance_type               = var.head_instance_type
  subnet_id                   = var.subnet_ids[0]
  vpc_security_group_ids      = [aws_security_group.serving.id]
  iam_instance_profile        = aws_iam_instance_profile.ray_head[0].name
  ebs_optimized               = true
  monitoring                  = var.detailed_monitoring
  user_data_base64            = base64gzip(local.head_user_data)
  user_data_replace_on_change = true

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "disabled"
  }

  root_block_device {
    volume_type           = "gp3"
    volume_size           = var.root_volume_size_gb
    encrypted             = true
    kms_key_id            = var.root_volume_kms_key_id
    delete_on_termination = true
    tags                  = var.tags
  }

  tags = merge(var.tags, { Name = "${var.name}-ray-head" })

  lifecycle {
    ignore_changes = [ami]
  }
}

resource "aws_launch_template" "serving" {
  count = local.use_asg ? 1 : 0

  name_prefix            = "${var.name}-serving-"
  description            = "ragkv serving replicas"
  image_id               = local.ami_id
  instance_type          = var.instance_type
  vpc_security_group_ids = [aws_security_group.serving.id]
  ebs_optimized          = true
  user_data              = base64gzip(var.ray_cluster ? local.worker_user_data : local.user_data)
  update_default_version = true

  iam_instance_profile {
    arn = aws_iam_instance_profile.serving.arn
  }

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "disabled"
  }

  monitoring {
    enabled = var.detailed_monitoring
  }

  block_device_mappings {
    device_name = var.root_device_name

    ebs {
      volume_type           = "gp3"
      volume_size           = var.root_volume_size_gb
      encrypted             = true
      kms_key_id            = var.root_volume_kms_key_id
      delete_on_termination = true
    }
  }

  dynamic "tag_specifications" {
    for_each = ["instance", "volume", "network-interface"]

    content {
      resource_type = tag_specifications.value
      tags          = merge(var.tags, { Name = "${var.name}-serving" })
    }
  }

  tags = var.tags
}

resource "aws_autoscaling_group" "serving" {
  count = local.use_asg ? 1 : 0

  name_prefix               = "${var.name}-serving-"
  vpc_zone_identifier       = var.subnet_ids
  min_size                  = var.asg_min_size
  max_size                  = var.asg_max_size
  desired_capacity          = var.asg_desired_capacity
  health_check_type         = var.create_load_balancer ? "ELB" : "EC2"
  health_check_grace_period = var.health_check_grace_period
  target_group_arns         = concat(aws_lb_target_group.grpc[*].arn, aws_lb_target_group.http[*].arn)

  launch_template {
    id      = aws_launch_template.serving[0].id
    version = aws_launch_template.serving[0].latest_version
  }

  instance_refresh {
    strategy = "Rolling"

    preferences {
      min_healthy_percentage = 50
    }
  }

  dynamic "tag" {
    for_each = merge(var.tags, { Name = "${var.name}-serving" })

    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }
}
