-- admit.lua: check, then charge, a tenant's admission of one submission: its Idempotency-Key
-- claim, queued-jobs quota and rate (`sluice.wire.broker.Broker.enqueue`, arguments by
-- `sluice.wire.quota.admit_call`).
--
-- KEYS[1]: the tenant's queued set (`sluice.wire.keys.queued_jobs`)
-- KEYS[2]: its rate bucket (`sluice.wire.keys.rate_bucket`)
-- KEYS[3]: the Idempotency-Key, when ARGV[6] is not ''
-- Every key carries the tag `{tenant}`: one slot, so the script runs on a Redis Cluster.
--
-- ARGV[1]: now, as the caller's clock says it
-- ARGV[2]: max_queued
-- ARGV[3]: the rate (tokens a second)
-- ARGV[4]: the burst
-- ARGV[5]: the queued set's ttl_s
-- ARGV[6]: the key's in-progress marker, or ''
-- ARGV[7]: the lease (ms) the key is renewed for
-- ARGV[8..]: per job to queue, its id and when its place frees (`sluice.wire.quota.frees_at`)
--
-- Returns: {'lost'} when the key is no longer this request's claim, {'quota', queued jobs},
-- {'rate', seconds to wait}, or {'ok'}.
--
-- Checked in that order; then every place is added and the key's lease renewed, so that it is
-- still this request's when the jobs are written and the key completed. A refusal charges
-- nothing. A submission whose every job was answered from the response cache passes no job: only
-- the key is checked.

-- Takes `cost` tokens from the bucket at `key` (refilled at `rate` a second up to `burst`).
-- Answers nil, or the seconds until there are enough; a refusal leaves the bucket as it was.
local function take_tokens(key, rate, burst, now, cost)
  local state = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens = tonumber(state[1]) or burst
  local ts = tonumber(state[2]) or now
  tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
  if tokens < cost then return (cost - tokens) / rate end
  redis.call('HSET', key, 'tokens', tostring(tokens - cost), 'ts', tostring(now))
  redis.call('EXPIRE', key, math.ceil(burst / rate) + 1)
  return nil
end

-- The number of the tenant's queued jobs, once those whose place has freed on its own are dropped.
local function queued_jobs(key, now)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  return redis.call('ZCARD', key)
end

local now = tonumber(ARGV[1])
if ARGV[6] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[6] then return {'lost'} end
local count = (#ARGV - 7) / 2
if count > 0 then
  local queued = queued_jobs(KEYS[1], ARGV[1])
  if queued + count > tonumber(ARGV[2]) then return {'quota', queued} end
  local wait = take_tokens(KEYS[2], tonumber(ARGV[3]), tonumber(ARGV[4]), now, count)
  if wait then return {'rate', tostring(wait)} end
  for i = 8, #ARGV, 2 do redis.call('ZADD', KEYS[1], ARGV[i + 1], ARGV[i]) end
  redis.call('EXPIRE', KEYS[1], ARGV[5])
end
if ARGV[6] ~= '' then redis.call('PEXPIRE', KEYS[3], ARGV[7]) end
return {'ok'}
