-- queue_webhook(job, outbox): queue a job's webhook on its version's outbox stream.
--
-- KEYS: none of its own; `job` (the job's hash) and `outbox` (its version's webhook outbox,
--   `sluice.wire.keys.outbox`) are keys the calling script was given, of one slot.
-- ARGV: none of its own.
--
-- Every script that makes a job final calls this: a job submitted with a callback_url gets its
-- webhook queued in the same atomic step as its final state, so no crash can keep one without the
-- other, and since a final state is written only once, a job processed twice still queues one
-- delivery. The delivery id is derived from the job id: one job, one delivery id. The entry's
-- field names are `sluice.wire.outbox.OutboxEntry`'s.
local function queue_webhook(job, outbox)
  if redis.call('HEXISTS', job, 'callback_url') == 0 then return end
  local id = redis.call('HGET', job, 'id')
  local delivery = 'dlv_' .. string.sub(redis.sha1hex('sluice-webhook:' .. id), 1, 32)
  redis.call('HSET', job, 'delivery_id', delivery)
  redis.call('XADD', outbox, '*', 'delivery', delivery, 'job', id)
end
