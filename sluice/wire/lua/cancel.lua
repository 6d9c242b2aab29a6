-- cancel.lua: cancel a queued job (`sluice.wire.broker.Broker.cancel`, and batch cancellation in
-- workers/batches.py).
--
-- KEYS[1]: the job's hash
-- KEYS[2]: its version's webhook outbox (same slot)
--
-- ARGV[1]: now
--
-- Returns: 'ok', or the state that prevents it ('missing', or the job's status: an already
-- cancelled job included).
--
-- Only a queued job can be cancelled. Its quota place is freed by the caller (another slot).
--!include lib/queue_webhook.lua
local s = redis.call('HGET', KEYS[1], 'status')
if not s then return 'missing' end
if s ~= 'queued' then return s end
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[1])
queue_webhook(KEYS[1], KEYS[2])
return 'ok'
