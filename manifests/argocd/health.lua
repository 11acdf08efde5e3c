-- Argo CD health of an ichor.maesh.dev TalosOperation, as kstatus (Flux, kpt)
-- reads it: Degraded while Stalled is True (refused, or a failed step with
-- nothing in flight), Healthy once Succeeded, Progressing otherwise.
local health = { status = "Progressing", message = "ichor-controller has not seen this generation yet" }
local status = obj.status
if status == nil or status.observedGeneration ~= obj.metadata.generation then
  return health
end
health.message = status.message or status.phase
for _, c in ipairs(status.conditions or {}) do
  if c.type == "Stalled" and c.status == "True" then
    health.status = "Degraded"
    health.message = c.message
    return health
  end
end
if status.phase == "Succeeded" then
  health.status = "Healthy"
end
return health
