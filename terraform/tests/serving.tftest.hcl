# Plan-level checks of the serving module, offline (mock AWS provider).

mock_provider "aws" {
  mock_data "aws_partition" {
    defaults = { partition = "aws" }
  }
  mock_data "aws_region" {
    defaults = { name = "us-east-1" }
  }
  mock_data "aws_caller_identity" {
    defaults = { account_id = "123456789012" }
  }
  mock_data "aws_ssm_parameter" {
    defaults = { insecure_value = "ami-0dlami0000000000", value = "ami-0dlami0000000000" }
  }
  # Known at plan time so the instance policy (which names the secrets key) can be inspected.
  mock_resource "aws_kms_key" {
    override_during = plan
    defaults = {
      arn    = "arn:aws:kms:us-east-1:123456789012:key/99999999-8888-7777-6666-555555555555"
      id     = "99999999-8888-7777-6666-555555555555"
      key_id = "99999999-8888-7777-6666-555555555555"
    }
  }
  mock_data "aws_vpc" {
    defaults = {
      cidr_block              = "10.0.0.0/16"
      cidr_block_associations = [{ association_id = "vpc-cidr-assoc-0123", cidr_block = "10.0.0.0/16", state = "associated" }]
    }
  }
}

variables {
  name           = "ragkv-test"
  vpc_id         = "vpc-0123456789abcdef0"
  subnet_ids     = ["subnet-0aaaaaaaaaaaaaaaa", "subnet-0bbbbbbbbbbbbbbbb"]
  kv_bucket_arn  = "arn:aws:s3:::ragkv-test-kv"
  kv_bucket_name = "ragkv-test-kv"
  kms_key_arn    = "arn:aws:kms:us-east-1:123456789012:key/11111111-2222-3333-4444-555555555555"
  allowed_cidrs  = ["10.0.0.0/17", "10.0.200.0/24"]
  tags           = { Project = "ragkv" }

  container_image    = "123456789012.dkr.ecr.us-east-1.amazonaws.com/ragkv-test:0.1.0@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
  ecr_repository_arn = "arn:aws:ecr:us-east-1:123456789012:repository/ragkv-test"
  api_keys_json      = "[{\"name\": \"ci\", \"key\": \"test-secret-key-0123456789\"}]"
  certificate_arn    = "arn:aws:acm:us-east-1:123456789012:certificate/11111111-2222-3333-4444-555555555555"
}

run "instance_defaults_are_hardened" {
  command = plan

  module {
    source = "./modules/serving"
  }

  assert {
    condition     = length(aws_instance.serving) == 1 && aws_instance.serving[0].instance_type == "g5.xlarge"
    error_message = "One g5.xlarge instance by default."
  }

  assert {
    condition     = aws_instance.serving[0].metadata_options[0].http_tokens == "required"
    error_message = "IMDSv2 must be required."
  }

  assert {
    condition     = aws_instance.serving[0].root_block_device[0].encrypted == true && aws_instance.serving[0].root_block_device[0].volume_type == "gp3"
    error_message = "The root volume must be encrypted gp3."
  }

  assert {
    condition     = aws_instance.serving[0].ami == "ami-0dlami0000000000"
    error_message = "The AMI must come from the Deep Learning AMI SSM parameter."
  }

  assert {
    condition     = data.aws_ssm_parameter.ami[0].name == "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
    error_message = "The default AMI lookup must use the public Deep Learning AMI parameter."
  }
}

run "ingress_only_from_named_clients" {
  command = plan

  module {
    source = "./modules/serving"
  }

  assert {
    condition     = length(aws_vpc_security_group_ingress_rule.cidr) == 4
    error_message = "Two CIDRs times two ports (gRPC, metrics) make four ingress rules."
  }

  assert {
    condition     = alltrue([for r in aws_vpc_security_group_ingress_rule.cidr : r.cidr_ipv4 != "0.0.0.0/0" && r.cidr_ipv6 == null])
    error_message = "No ingress rule may admit the whole internet."
  }

  assert {
    condition     = toset([for r in aws_vpc_security_group_ingress_rule.cidr : r.from_port]) == toset([50051, 9464])
    error_message = "Only the gRPC (50051) and metrics (9464) ports may be opened."
  }

  assert {
    condition     = alltrue([for r in aws_vpc_security_group_ingress_rule.cidr : r.from_port == r.to_port])
    error_message = "Ingress rules must open single ports, not ranges."
  }

  assert {
    condition     = output.metrics_host == "0.0.0.0" && strcontains(output.user_data, "--metrics-host 0.0.0.0 --metrics-port 9464")
    error_message = "With every client CIDR inside the VPC, /metrics listens on every interface (the security group admits only those)."
  }
}

run "metrics_stay_on_loopback_for_clients_outside_the_vpc" {
  command = plan

  module {
    source = "./modules/serving"
  }

  variables {
    allowed_cidrs = ["10.0.0.0/16", "192.168.10.0/24"]
  }

  assert {
    condition     = output.metrics_host == "127.0.0.1" && strcontains(output.user_data, "--metrics-host 127.0.0.1 --metrics-port 9464")
    error_message = "A client CIDR outside the VPC: /metrics (no credentials) must stay on loopback."
  }

  assert {
    condition     = toset([for r in aws_vpc_security_group_ingress_rule.cidr : r.from_port]) == toset([50051])
    error_message = "The metrics port gets no ingress rule while it listens on loopback."
  }
}

run "no_ingress_at_all_by_default" {
  command = plan

  module {
    source = "./modules/serving"
  }

  variables {
    allowed_cidrs = []
  }

  assert {
    condition     = length(aws_vpc_security_group_ingress_rule.cidr) == 0 && length(aws_vpc_security_group_ingress_rule.sg) == 0
    error_message = "Without allowed_cidrs or allowed_security_group_ids nothing may be admitted."
  }
}

run "public_ingress_is_refused" {
  command = plan

  module {
    source = "./modules/serving"
  }

  variables {
    allowed_cidrs = ["0.0.0.0/0"]
  }

  expect_failures = [var.allowed_cidrs]
}

run "public_ingress_in_large_blocks_is_refused" {
  command = plan

  module {
    source = "./modules/serving"
  }

  variables {
    allowed_cidrs = ["10.0.0.0/8", "0.0.0.0/2", "64.0.0.0/2", "128.0.0.0/1"]
  }

  expect_failures = [var.allowed_cidrs]
}

run "iam_is_limited_to_the_kv_prefix_and_key" {
  command = plan

  module {
    source = "./modules/serving"
  }

  assert {
    condition = alltrue([
      for s in jsondecode(aws_iam_role_policy.kv_access.policy).Statement :
      (!contains(flatten([s.Resource]), "*") || s.Action == ["ecr:GetAuthorizationToken"]) && !contains(flatten([s.Action]), "s3:*")
    ])
    error_message = "No statement may use Resource \"*\" (but ECR's login, which takes no other) or s3:*."
  }

  assert {
    condition = anytrue([
      for s in jsondecode(aws_iam_role_policy.kv_access.policy).Statement :
      s.Resource == "arn:aws:s3:::ragkv-test-kv/kv/*" && s.Action == ["s3:GetObject"]
    ])
    error_message = "The hosts read every KV file under the KV prefix."
  }

  assert {
    condition = alltrue([
      for s in jsondecode(aws_iam_role_policy.kv_access.policy).Statement :
      s.Resource == "arn:aws:s3:::ragkv-test-kv/kv/serve-writeback/*" if contains(flatten([s.Action]), "s3:PutObject")
    ])
    error_message = "The hosts may write KV back only under their own serve-writeback prefix."
  }

  assert {
    condition = alltrue([
      for s in jsondecode(aws_iam_role_policy.kv_access.policy).Statement : !contains(flatten([s.Action]), "s3:DeleteObject")
    ])
    error_message = "A serving host may delete no object."
  }

  assert {
    condition = anytrue([
      for s in jsondecode(aws_iam_role_policy.kv_access.policy).Statement :
      s.Action == ["s3:ListBucket"] && s.Resource == "arn:aws:s3:::ragkv-test-kv" && !can(s.Condition)
    ])
    error_message = "ListBucket must be granted on the bucket without a prefix condition, so S3 answers a missing KV object with 404, not 403."
  }

  assert {
    condition = alltrue([
      for s in jsondecode(aws_iam_role_policy.kv_access.policy).Statement :
      s.Resource == "arn:aws:ecr:us-east-1:123456789012:repository/ragkv-test" if contains(flatten([s.Action]), "ecr:BatchGetImage")
    ])
    error_message = "Image pulls must be limited to the deployment's repository."
  }

  assert {
    condition = alltrue([
      for s in jsondecode(aws_iam_role_policy.kv_access.policy).Statement :
      s.Resource == "arn:aws:ssm:us-east-1:123456789012:parameter/ragkv-test/api-keys" if anytrue([for a in flatten([s.Action]) : startswith(a, "ssm:")])
    ])
    error_message = "A standalone host may read exactly one SSM parameter, its API keys file."
  }

  assert {
    condition = length(aws_iam_role_policy.session_manager) == 1 && alltrue([
      for s in jsondecode(aws_iam_role_policy.session_manager["serving"].policy).Statement :
      alltrue([for a in flatten([s.Action]) : !startswith(a, "ssm:Get") && !strcontains(a, "*") && !startswith(a, "s3:") && !startswith(a, "kms:")])
    ])
    error_message = "Session Manager's policy grants the agent's own actions only: no SSM parameter reads (AmazonSSMManagedInstanceCore's account-wide ssm:GetParameter*), no wildcards."
  }
}

run "api_keys_live_in_ssm_under_their_own_key" {
  command = plan

  module {
    source = "./modules/serving"
  }

  assert {
    condition     = aws_ssm_parameter.api_keys.type == "SecureString" && aws_ssm_parameter.api_keys.key_id == aws_kms_key.secrets.arn && aws_ssm_parameter.api_keys.name == "/ragkv-test/api-keys"
    error_message = "The API keys file is an SSM SecureString under the tier's own KMS key."
  }

  assert {
    condition     = aws_kms_key.secrets.enable_key_rotation == true
    error_message = "The secrets key rotates."
  }

  assert {
    condition     = !strcontains(output.user_data, "test-secret-key-0123456789") && strcontains(output.user_data, "aws ssm get-parameter --region us-east-1 --name /ragkv-test/api-keys --with-decryption")
    error_message = "The keys never travel in user data: the host reads them from SSM at boot."
  }

  assert {
    condition     = strcontains(output.user_data, "chmod 0400 \"$tmp\"") && strcontains(output.user_data, "--volume /etc/ragkv/api-keys.json:/etc/ragkv/api-keys.json:ro")
    error_message = "The keys file is readable by the container's user only and mounted read-only."
  }

  assert {
    condition = anytrue([
      for s in jsondecode(aws_iam_role_policy.kv_access.policy).Statement :
      s.Action == ["kms:Decrypt"] && s.Resource == aws_kms_key.secrets.arn && try(s.Condition.StringEquals["kms:ViaService"], "") == "ssm.us-east-1.amazonaws.com"
    ])
    error_message = "The hosts may decrypt with the secrets key only through SSM."
  }
}

run "api_keys_must_be_a_list_of_named_keys" {
  command = plan

  module {
    source = "./modules/serving"
  }

  variables {
    api_keys_json = "{\"key\": \"no-name\"}"
  }

  expect_failures = [var.api_keys_json]
}

run "credentials_in_user_data_are_refused" {
  command = plan

  module {
    source = "./modules/serving"
  }

  variables {
    environment = { RAGKV_AUTH_TOKEN = "would-reach-every-host-in-clear" }
  }

  expect_failures = [var.environment]
}

run "user_data_runs_ragkv_serve_under_systemd" {
  command = plan

  module {
    source = "./modules/serving"
  }

  assert {
    condition     = strcontains(output.user_data, "123456789012.dkr.ecr.us-east-1.amazonaws.com/ragkv-test:0.1.0@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef ragkv serve --index s3://ragkv-test-kv/index/latest --model smollm2-135m-instruct --host 0.0.0.0 --port 50051 --metrics-host 0.0.0.0 --metrics-port 9464 --api-keys /etc/ragkv/api-keys.json")
    error_message = "The unit must run `ragkv serve` in the deployment's image, pinned by digest, on every interface with the API keys file."
  }

  assert {
    condition     = strcontains(output.user_data, "Restart=always") && strcontains(output.user_data, "systemctl enable --now")
    error_message = "ragkv must run under systemd with restarts."
  }

  assert {
    condition     = strcontains(output.user_data, "RAGKV_KV_S3_URI=s3://ragkv-test-kv/kv") && strcontains(output.user_data, "Amazon EC2 NVMe Instance Storage")
    error_message = "User data must wire the S3 tier and the NVMe instance store."
  }

  assert {
    condition     = strcontains(output.user_data, "docker login --username AWS --password-stdin 123456789012.dkr.ecr.us-east-1.amazonaws.com") && strcontains(output.user_data, "docker pull --quiet 123456789012.dkr.ecr.us-east-1.amazonaws.com/ragkv-test:0.1.0@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef") && !strcontains(output.user_data, "pip install")
    error_message = "User data must pull the image from the deployment's registry and install nothing by name."
  }

  assert {
    condition     = strcontains(output.user_data, "/opt/dlami/nvme") && strcontains(output.user_data, "Wants=network-online.target ragkv-ssd.service")
    error_message = "The SSD tier must use the DLAMI's own NVMe mount, and ragkv must serve without it."
  }

  assert {
    condition     = aws_instance.serving[0].user_data_replace_on_change == true && aws_instance.serving[0].monitoring == true
    error_message = "A new image or index version must replace the instance (user data runs on first boot only); detailed monitoring is on by default."
  }
}

run "image_must_come_from_ecr" {
  command = plan

  module {
    source = "./modules/serving"
  }

  variables {
    container_image = "ragkv:latest"
  }

  expect_failures = [var.container_image]
}

run "image_must_be_pinned_by_digest" {
  command = plan

  module {
    source = "./modules/serving"
  }

  variables {
    container_image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/ragkv-test:0.1.0"
  }

  expect_failures = [var.container_image]
}

run "autoscaling_group_behind_nlb" {
  command = plan

  module {
    source = "./modules/serving"
  }

  variables {
    create_autoscaling_group = true
    create_load_balancer     = true
    asg_desired_capacity     = 2
    asg_max_size             = 3
  }

  assert {
    condition     = length(aws_instance.serving) == 0 && length(aws_autoscaling_group.serving) == 1
    error_message = "With an Auto Scaling group there are no standalone instances."
  }

  assert {
    condition     = aws_launch_template.serving[0].metadata_options[0].http_tokens == "required"
    error_message = "IMDSv2 must be required in the launch template."
  }

  assert {
    condition     = aws_launch_template.serving[0].block_device_mappings[0].ebs[0].encrypted == "true"
    error_message = "The launch template's root volume must be encrypted."
  }

  assert {
    condition     = aws_lb.serving[0].load_balancer_type == "network" && aws_lb.serving[0].internal == true
    error_message = "The load balancer must be an internal NLB."
  }

  assert {
    condition = (
      aws_lb_target_group.grpc[0].health_check[0].protocol == "HTTP"
      && aws_lb_target_group.grpc[0].health_check[0].port == "8081"
      && aws_lb_target_group.grpc[0].health_check[0].path == "/grpc.health.v1.Health/Check"
    )
    error_message = "The target group must check the grpc.health.v1 bridge."
  }

  assert {
    condition     = aws_autoscaling_group.serving[0].health_check_type == "ELB"
    error_message = "Replicas must be replaced when the load balancer finds them unhealthy."
  }

  assert {
    condition     = alltrue([for r in aws_vpc_security_group_ingress_rule.lb_cidr : r.cidr_ipv4 != "0.0.0.0/0"])
    error_message = "The load balancer must not admit the whole internet."
  }

  assert {
    condition     = alltrue([for r in aws_vpc_security_group_ingress_rule.cidr : r.from_port != 50051])
    error_message = "Behind the load balancer, clients reach gRPC through its TLS listener only, never the instances' plaintext port."
  }

  assert {
    condition     = length([for r in aws_vpc_security_group_ingress_rule.lb_cidr : r if r.from_port == 50051]) == 2
    error_message = "The load balancer admits the named clients to its gRPC listener."
  }

  assert {
    condition = (
      aws_lb_listener.grpc[0].protocol == "TLS"
      && aws_lb_listener.grpc[0].certificate_arn == "arn:aws:acm:us-east-1:123456789012:certificate/11111111-2222-3333-4444-555555555555"
      && aws_lb_listener.grpc[0].ssl_policy == "ELBSecurityPolicy-TLS13-1-2-2021-06"
      && aws_lb_listener.grpc[0].alpn_policy == "HTTP2Preferred"
    )
    error_message = "The gRPC listener terminates TLS 1.2+ with the ACM certificate and offers h2 through ALPN."
  }
}

run "load_balancer_needs_a_certificate" {
  command = plan

  module {
    source = "./modules/serving"
  }

  variables {
    create_autoscaling_group = true
    create_load_balancer     = true
    certificate_arn          = null
  }

  expect_failures = [var.certificate_arn]
}

run "plaintext_listeners_only_when_opted_in" {
  command = plan

  module {
    source = "./modules/serving"
  }

  variables {
    create_autoscaling_group  = true
    create_load_balancer      = true
    certificate_arn           = null
    allow_plaintext_listeners = true
  }

  assert {
    condition     = aws_lb_listener.grpc[0].protocol == "TCP" && aws_lb_listener.grpc[0].certificate_arn == null
    error_message = "allow_plaintext_listeners gives a plaintext TCP listener."
  }
}

run "weak_tls_policies_are_refused" {
  command = plan

  module {
    source = "./modules/serving"
  }

  variables {
    ssl_policy = "ELBSecurityPolicy-2016-08"
  }

  expect_failures = [var.ssl_policy]
}

run "explicit_ami_skips_the_lookup" {
  command = plan

  module {
    source = "./modules/serving"
  }

  variables {
    ami_id = "ami-0123456789abcdef0"
  }

  assert {
    condition     = length(data.aws_ssm_parameter.ami) == 0 && aws_instance.serving[0].ami == "ami-0123456789abcdef0"
    error_message = "ami_id must override the SSM lookup."
  }
}

run "ray_cluster_head_workers_and_ports" {
  # apply (against the mock provider): the workers' user data names the head's private IP
  command = apply

  module {
    source = "./modules/serving"
  }

  variables {
    ray_cluster          = true
    create_load_balancer = true
    asg_desired_capacity = 2
    asg_max_size         = 4
    ray_replicas         = 2
  }

  # the mock provider's random ids are no ARNs; the resources that take one get real-looking values
  override_resource {
    target = aws_lb.serving
    values = { arn = "arn:aws:elasticloadbalancing:us-east-1:123456789012:loadbalancer/net/rkv/0123456789abcdef" }
  }
  override_resource {
    target = aws_lb_target_group.grpc
    values = { arn = "arn:aws:elasticloadbalancing:us-east-1:123456789012:targetgroup/rkv/0123456789abcdef" }
  }
  override_resource {
    target = aws_lb_target_group.http
    values = { arn = "arn:aws:elasticloadbalancing:us-east-1:123456789012:targetgroup/rkvh/0123456789abcdef" }
  }
  override_resource {
    target = aws_iam_instance_profile.serving
    values = { arn = "arn:aws:iam::123456789012:instance-profile/ragkv-test-serving" }
  }
  override_resource {
    target = aws_launch_template.serving
    values = { id = "lt-0123456789abcdef0", latest_version = 1 }
  }
  override_resource {
    target = aws_instance.ray_head
    values = { id = "i-0123456789abcdef0", private_ip = "10.0.1.10" }
  }

  assert {
    condition     = length(aws_instance.ray_head) == 1 && aws_instance.ray_head[0].instance_type == "m6i.2xlarge" && length(aws_instance.serving) == 0
    error_message = "A Ray cluster has one on-demand head node and no standalone hosts."
  }

  assert {
    condition     = length(aws_autoscaling_group.serving) == 1 && aws_launch_template.serving[0].instance_type == "g5.xlarge"
    error_message = "The workers are the Auto Scaling group's g5 instances."
  }

  assert {
    condition     = strcontains(output.ray_user_data.head, "ray start --head --port 6379 --dashboard-agent-grpc-port 6382") && strcontains(output.ray_user_data.head, "--node-manager-port 6380 --object-manager-port 6381") && strcontains(output.ray_user_data.head, "ragkv serve --index s3://ragkv-test-kv/index/latest --model smollm2-135m-instruct --replicas 2 --ray-address auto --gpus-per-replica 1")
    error_message = "The head starts Ray's head and deploys `ragkv serve --replicas` on it."
  }

  assert {
    condition     = strcontains(output.ray_user_data.worker, "ray start --address 10.0.1.10:6379 --dashboard-agent-grpc-port 6382") && !strcontains(output.ray_user_data.worker, "exec ragkv serve")
    error_message = "A worker joins the head's Ray with its GPU and runs nothing else."
  }

  assert {
    condition = length(aws_vpc_security_group_ingress_rule.ray_internal) == 2 && alltrue([
      for r in aws_vpc_security_group_ingress_rule.ray_internal : r.referenced_security_group_id == aws_security_group.serving.id && r.to_port < 20000
    ])
    error_message = "Ray's ports (named, not every port) are open only inside the cluster's security group."
  }

  assert {
    condition = alltrue([
      for r in aws_vpc_security_group_ingress_rule.cidr : contains([50051, 9464, 8000], r.from_port) && r.from_port == r.to_port
    ])
    error_message = "Clients reach only gRPC, metrics and the HTTP API, one port each: never a Ray port."
  }

  assert {
    condition     = length(aws_lb_listener.http) == 1 && aws_lb_listener.http[0].port == 8000 && aws_lb_target_group.grpc[0].health_check[0].path == "/-/healthz"
    error_message = "The load balancer forwards gRPC and HTTP to Ray Serve's proxies, checked at /-/healthz."
  }

  assert {
    condition     = length(aws_lb_target_group_attachment.head) == 2
    error_message = "The head node's proxies are targets too."
  }

  assert {
    condition = anytrue([
      for s in jsondecode(aws_iam_role_policy.kv_access.policy).Statement :
      s.Action == ["ssm:GetParameter"] && s.Resource == "arn:aws:ssm:us-east-1:123456789012:parameter/ragkv-test/ray-auth-token"
      ]) && alltrue([
      for s in jsondecode(aws_iam_role_policy.kv_access.policy).Statement : !contains(flatten([s.Action]), "ssm:PutParameter")
    ])
    error_message = "The workers may only read their cluster's Ray token parameter."
  }

  assert {
    condition = anytrue([
      for s in jsondecode(aws_iam_role_policy.ray_head[0].policy).Statement :
      contains(s.Action, "ssm:PutParameter") && s.Resource == "arn:aws:ssm:us-east-1:123456789012:parameter/ragkv-test/ray-auth-token"
    ]) && aws_instance.ray_head[0].iam_instance_profile == aws_iam_instance_profile.ray_head[0].name
    error_message = "Only the head (its own role) may write the cluster's Ray token parameter."
  }

  assert {
    condition = (
      length(aws_ssm_parameter.ray_token) == 1
      && aws_ssm_parameter.ray_token[0].type == "SecureString"
      && aws_ssm_parameter.ray_token[0].name == "/ragkv-test/ray-auth-token"
      && aws_ssm_parameter.ray_token[0].key_id == aws_kms_key.secrets.arn
      && strcontains(output.ray_user_data.head, "--key-id")
    )
    error_message = "The Ray token parameter is made by Terraform as a SecureString under the tier's own KMS key (not aws/ssm), and the head writes the token under that key."
  }

  assert {
    condition     = strcontains(output.ray_user_data.head, "--host 0.0.0.0 --port 50051 --http-port 8000 --metrics-host 0.0.0.0 --metrics-port 9464 --api-keys /etc/ragkv/api-keys.json") && strcontains(output.ray_user_data.worker, "ExecStartPre=/usr/local/sbin/ragkv-api-keys")
    error_message = "The head serves every interface with the API keys file, which every node reads from SSM."
  }

  assert {
    condition     = length(aws_iam_role_policy.session_manager) == 2
    error_message = "Session Manager's scoped policy goes to both roles."
  }
}
