-- admit.lua: check, then charge, a tenant's admission of one submission: its Idempotency-Key
-- claim, queued-jobs quota, stored answered jobs and rate (`sluice.wire.broker.Broker.enqueue`,
-- arguments by `sluice.wire.quota.admit_call`).
--
-- KEYS[1]: the tenant's queued set (`sluice.wire.keys.queued_jobs`)
-- KEYS[2]: its rate bucket (`sluice.wire.keys.rate_bucket`)
-- KEYS[3]: its answered set (`sluice.wire.keys.answered_jobs`)
-- KEYS[4]: the Idempotency-Key, when ARGV[6] is not ''
-- Every key carries the tag `{tenant}`: one slot, so the script runs on a Redis Cluster.
--
-- ARGV[1]: now, as the caller's clock says it
-- ARGV[2]: max_queued
-- ARGV[3]: the rate (tokens a second)
-- ARGV[4]: the burst
-- ARGV[5]: the ttl_s of the queued and answered sets
-- ARGV[6]: the key's in-progress marker, or ''
-- ARGV[7]: the lease (ms) the key is renewed for
-- ARGV[8]: max_answered, the answered jobs the tenant may have stored
-- ARGV[9]: the tokens the submission costs (`sluice.wire.quota.token_cost`)
-- ARGV[10]: the number of jobs to queue
-- ARGV[11..]: per job to queue, its id and when its place frees (`sluice.wire.quota.frees_at`);
--   then per job answered from the response cache, its id and when its record expires
--
-- Returns: {'lost'} when the key is no longer this request's claim, {'quota', queued jobs},
-- {'stored', seconds until enough stored answers expire, or -1 if they never can},
-- {'rate', seconds to wait}, or {'ok'}.
--
-- Checked in that order; then every place and answer is added, the tokens taken and the key's
-- lease renewed, so that it is still this request's when the jobs are written and the key
-- completed. A refusal charges nothing. An answered job is checked against the quota as if queued
-- and answered at once: it takes no place, but a tenant at its quota gets no jobs at all.

-- Takes `cost` tokens from the bucket at `key` (refilled at `rate` a second up to `burst`).
-- A cost above the burst needs a full bucket and leaves the rest as debt (tokens below zero),
-- which the refill pays before anything else passes. The bucket lives until it would be full
-- again, so that its expiry forgives no debt. Answers nil, or the seconds until there are enough;
-- a refusal leaves the bucket as it was.
local function take_tokens(key, rate, burst, now, cost)
  local state = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens = tonumber(state[1]) or burst
  local ts = tonumber(state[2]) or now
  tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
  local need = math.min(cost, burst)
  if tokens < need then return (need - tokens) / rate end
  tokens = tokens - cost
  redis.call('HSET', key, 'tokens', tostring(tokens), 'ts', tostring(now))
  redis.call('EXPIRE', key, math.ceil((burst - tokens) / rate) + 1)
  return nil
end

-- The members of the set at `key` whose score (when they stop counting) is still ahead.
local function live_members(key, now)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  return redis.call('ZCARD', key)
end

-- Seconds until `over` of the answers stored at `key` have expired, or -1 if there are fewer.
local function stored_wait(key, over, now)
  local nth = redis.call('ZRANGE', key, over - 1, over - 1, 'WITHSCORES')
  if #nth == 0 then return -1 end
  return tonumber(nth[2]) - now
end

local now = tonumber(ARGV[1])
if ARGV[6] ~= '' and redis.call('GET', KEYS[4]) ~= ARGV[6] then return {'lost'} end
local count = tonumber(ARGV[10])
local first_hit = 11 + 2 * count
local hits = (#ARGV - first_hit + 1) / 2
if count + hits > 0 then
  local queued = live_members(KEYS[1], now)
  if queued + count + hits > tonumber(ARGV[2]) then return {'quota', queued} end
end
if hits > 0 then
  local over = live_members(KEYS[3], now) + hits - tonumber(ARGV[8])
  if over > 0 then return {'stored', tostring(stored_wait(KEYS[3], over, now))} end
end
local cost = tonumber(ARGV[9])
if cost > 0 then
  local wait = take_tokens(KEYS[2], tonumber(ARGV[3]), tonumber(ARGV[4]), now, cost)
  if wait then return {'rate', tostring(wait)} end
end
if count > 0 then
  for i = 11, first_hit - 1, 2 do redis.call('ZADD', KEYS[1], ARGV[i + 1], ARGV[i]) end
  redis.call('EXPIRE', KEYS[1], ARGV[5])
end
if hits > 0 then
  for i = first_hit, #ARGV, 2 do redis.call('ZADD', KEYS[3], ARGV[i + 1], ARGV[i]) end
  redis.call('EXPIRE', KEYS[3], ARGV[5])
end
if ARGV[6] ~= '' then redis.call('PEXPIRE', KEYS[4], ARGV[7]) end
return {'ok'}
