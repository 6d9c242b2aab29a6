-- delivery_end.lua: record the outcome of one attempt at a webhook delivery (workers/delivery.py).
--
-- KEYS[1]: the delivery's hash (`sluice.wire.keys.delivery`)
-- KEYS[2]: the due set (`sluice.wire.keys.WEBHOOK_DUE`, the same slot)
-- KEYS[3]: the tenant's attempts in flight (`sluice.wire.keys.webhook_tenant_slots`, the same slot)
--
-- ARGV[1]: the lease token
-- ARGV[2]: the outcome: delivered, retrying or failed
-- ARGV[3]: now
-- ARGV[4]: the next attempt's time ('' unless retrying)
-- ARGV[5]: the HTTP status ('' if none)
-- ARGV[6]: the error ('' if none)
-- ARGV[7]: the delivery id
--
-- Returns: 1 if it recorded the outcome, else 0.
--
-- A delivered delivery stays delivered; an attempt whose lease was taken over records only a
-- success. Whatever it records, the attempt gives back its place in its tenant's share.
redis.call('ZREM', KEYS[3], ARGV[1])
if redis.call('HGET', KEYS[1], 'status') == 'delivered' then return 0 end
if ARGV[2] ~= 'delivered' and redis.call('HGET', KEYS[1], 'lease') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'updated_at', ARGV[3], 'lease_until', '0',
  'last_status', ARGV[5], 'last_error', ARGV[6])
if ARGV[2] == 'delivered' then redis.call('HSET', KEYS[1], 'delivered_at', ARGV[3]) end
if ARGV[2] == 'retrying' then
  redis.call('HSET', KEYS[1], 'next_at', ARGV[4])
  redis.call('ZADD', KEYS[2], tonumber(ARGV[4]), ARGV[7])
else
  redis.call('ZREM', KEYS[2], ARGV[7])
end
return 1
