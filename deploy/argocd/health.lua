-- Argo CD resource health for tpufinetune.dev/TPUFineTune (argocd-cm key
-- resource.customizations.health.tpufinetune.dev_TPUFineTune; see argocd-cm.yaml).
--   Succeeded                                       -> Healthy
--   Pending, Queued (waiting for Kueue's quota, or
--   evicted and waiting again), Provisioning,
--   Submitting, Running, Deleting, or no status yet -> Progressing
--   Pending with spec.suspend (slice released)      -> Suspended
--   Failed                                          -> Degraded
-- The message is status.message, prefixed with the phase.
local hs = {}
local spec = obj.spec or {}
local status = obj.status or {}
local phase = status.phase

local function described(default)
  if status.message ~= nil and status.message ~= "" then
    return phase .. ": " .. status.message
  end
  return default
end

if phase == nil or phase == "" then
  if spec.suspend == true then
    hs.status = "Suspended"
    hs.message = "spec.suspend is true: no RayCluster is created"
  else
    hs.status = "Progressing"
    hs.message = "waiting for the operator to pick the resource up"
  end
elseif phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = described("the run succeeded")
elseif phase == "Failed" then
  hs.status = "Degraded"
  hs.message = described("the run failed")
elseif phase == "Pending" and spec.suspend == true then
  hs.status = "Suspended"
  hs.message = described("suspended")
elseif phase == "Pending" or phase == "Queued" or phase == "Provisioning" or phase == "Submitting"
    or phase == "Running" or phase == "Deleting" then
  hs.status = "Progressing"
  hs.message = described(phase)
else
  hs.status = "Unknown"
  hs.message = "unknown phase " .. tostring(phase)
end
return hs
